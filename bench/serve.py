"""Serving under load. http: `mlcc serve` under load, one server per run: TTFT and inter-token latency percentiles
over a request-rate sweep, then a soak with client disconnects, then (optionally) batched throughput against
transformers. prefix-cpu / prefix-load: automatic prefix caching (runtime.core.prefix_cache) in one process, time to
first token with a shared prefix, cache on vs off. throughput: `mlcc bench throughput` (trtllm-bench style: fixed
input/output lengths, all requests at once, greedy, EOS ignored) on shape-only CUDA builds with random weights,
beside transformers' `generate_batch` (fp16) on the same shape and prompts, same device, same run.

    python bench/decode.py build --out LIBS --only llama3-8b/q4f16_1,llama3-8b/q0f16    # here
    python bench/serve.py throughput --libs LIBS --out OUT                              # the CUDA machine

    python bench/serve.py http --model DIR --target cuda --out OUT                  # the CUDA machine
    python bench/serve.py http --target llvm --rates 0.5,1 --num-prompts 8 --output-len 16 --soak-seconds 20 \
        --soak-clients 4 --out /tmp/serve                                           # this CPU, the bundled SmolLM2
    python bench/serve.py prefix-cpu --out /tmp/prefix-cache                        # this CPU, the bundled SmolLM2
    python bench/serve.py prefix-load --model DIR --weights random --target cuda --out OUT   # e.g. the 8B shape

The soak on the Llama-3-8B shape (the CUDA machine, ~8 minutes on an H100: server start with the kernels compiled
at load, the sweep ~1.5 min, the soak 5 min). `build` writes a shape-only folder (library, config, tokenizer: ~7 MB,
so it travels with the checkout; .dev/ is git-ignored) that the server fills with random weights:

    python bench/serve.py build --out .dev/soak8b                                 # any machine, ~1 min
    python bench/serve.py http --model .dev/soak8b --weights random --target cuda --rates 2,8,32 \
        --soak-seconds 300 --soak-clients 256 --out OUT                            # the CUDA machine

and its stand-in on this CPU, the same recipe on a 4-layer SmolLM2-135M shape (~30 s of soak, ~2 min in all):

    python bench/serve.py build --out /tmp/soak-tiny --shape smollm2-135m --quant q4f32_1 --target llvm --layers 4
    python bench/serve.py http --model /tmp/soak-tiny --weights random --target llvm --rates 1,4 --num-prompts 8 \
        --output-len 32 --soak-seconds 30 --soak-clients 8 --out /tmp/soak

build: a preset's shape (--shape, default llama3-8b; --layers to cut its depth) for --target in --quant, no
checkpoint, with a real tokenizer and chat template (--tokenizer-gguf, default the bundled SmolLM2-135M-Instruct's:
the OpenAI endpoints take text, unlike the placeholder tokenizer of `bench/decode.py build`). The shape's vocab_size
is set to the tokenizer's token count (49,152 for SmolLM2, in place of Llama 3's 128,256), so that every id the
random model samples decodes to text; the embedding and the logits are that much smaller than the real 8B's.

http:
1. Sweep: open-loop Poisson arrivals at each --rates value (mlcc.runtime.serve.loadgen, what `mlcc bench serve`
   runs), streaming completions with a fixed output length (EOS ignored); per rate TTFT and ITL p50/p90/p99 (ms),
   output tok/s, errors.
2. Soak: --soak-clients concurrent streaming chat clients for --soak-seconds, random prompts and lengths, 20% of
   the requests disconnecting after 1-20 chunks, and every --probe-every seconds a greedy probe (a fixed prompt,
   temperature 0, --probe-tokens tokens, EOS ignored) whose text must equal the first probe's. Failed requests are
   counted as 5xx (an HTTP status of 500 or more, or a server error reported inside a stream after its 200 headers;
   the server's own count of 5xx responses from /metrics beside it) or as other errors. Pass: 0 errors, 0 5xx, every
   probe's text the first's, 0 KV pages in use once idle, the server alive; the sweep without errors. serve.json's
   "latency" holds each rate's TTFT and ITL p50/p99.
3. --batched: the same 256 prompts x 128 new tokens submitted at once to mlcc's Engine (max_batch 64) and to
   transformers' continuous batching (`generate_batch`, fp16, the SmolLM2 shape with random weights; CUDA only).
--shared-prefix F: that fraction of every sweep prompt is the same for all requests (a common system prompt); with
--prefix-ab the sweep runs twice, on a server with the prefix cache (the default) and on one started with
--no-prefix-cache, same prompts and arrivals (rows "sweep" and "sweep_no_prefix_cache"); for shape-only builds
(no tokenizer) prefix-load runs the same comparison in one process:

    python bench/serve.py http --model DIR --target cuda --shared-prefix 0.9 --input-len 800 --prefix-ab \
        --soak-seconds 0 --out OUT
The server runs with --max-batch = max(--soak-clients, 8) and the max_util policy (preempt and recompute).
Writes serve.json to --out.

prefix-cpu: the bundled SmolLM2-135M (real weights, llvm) with a ~1,200-token system prompt.
  1. TTFT of a request whose system prompt is cached (an earlier request with another question read it) against a
     cold one (cache emptied first), --repeats pairs, medians; and the same second request with the cache off.
  2. A 10-turn chat on that system prompt (32-token answers fed back as assistant messages): TTFT per turn, with
     the cache and without.
prefix-load: the serving load in one process on any artifacts folder, a shape-only build included (`bench/decode.py
  build`; token ids, no tokenizer: --weights random): --requests prompts of --prompt-len tokens whose first
  --shared fraction is the same for all, Poisson arrivals at --rate (0: all at once), --output-len tokens each (EOS
  ignored), greedy; the same prompts and arrival times with the prefix cache on and off, one engine after the
  other: output tok/s, TTFT p50/p99, the cache's token hit rate.
Each writes prefix_cache_cpu.json / prefix_cache_load.json to --out with the 1-minute load average before and after
(timings on a busy machine are noisy).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from harness import add_options_argument, build_info, build_shape_with_tokenizer, cli, device_name, presets, write_json

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def metric(base: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def server_5xx(base: str) -> float:
    """Responses the server itself sent with a 5xx status (mlcc_requests_total, every endpoint)."""
    import httpx

    return sum(float(line.split()[-1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
               if line.startswith("mlcc_requests_total{") and 'status="5' in line)


def start_server(a, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlcc", "serve", *([a.model] if a.model else []), "--target", a.target,
           "--port", str(port), "--max-batch", str(max(a.soak_clients, 8)), "--policy", "max_util",
           "--weights", a.weights, *extra]
    log = open(Path(a.out) / f"server{'-'.join(('',) + extra)}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def sweep(base: str, a) -> list[dict]:
    from mlcc.runtime.serve.loadgen import print_table, run_load

    rows = [asyncio.run(run_load(f"{base}/v1", None, "none", a.num_prompts, a.input_len, a.output_len, rate, None,
                                 shared_prefix=a.shared_prefix))
            for rate in (float(x) for x in a.rates.split(",") if x)]
    print_table(rows)
    return rows


async def client_loop(base: str, model: str, stop_at: float, rng: random.Random, stats: dict) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300) as client:
        while time.monotonic() < stop_at:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200)))
            max_tokens = rng.randint(16, 160)
            cut = rng.randint(1, 20) if rng.random() < 0.2 else None
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=0.7, stream=True)
                n = 0
                async for _ in stream:
                    n += 1
                    if cut is not None and n >= cut:
                        await stream.close()  # a client disconnecting mid-stream
                        stats["disconnects"] += 1
                        break
                else:
                    stats["completed"] += 1
                stats["chunks"] += n
            except Exception as e:  # noqa: BLE001 - counted, reported
                count_error(stats, e)


def count_error(stats: dict, e: Exception) -> None:
    """A failed request, as an HTTP 5xx or as another error. A stream whose 200 headers are out reports a server
    failure in band (an error event of type server_error): counted with the 5xx, since it is the same failure."""
    import openai

    status = getattr(e, "status_code", None)
    in_band = isinstance(e, openai.APIError) and isinstance(e.body, dict) and e.body.get("type") == "server_error"
    kind = "http_5xx" if (status is not None and status >= 500) or (status is None and in_band) else "errors"
    stats[kind] += 1
    stats["error_samples"].add(f"{kind} {type(e).__name__}: {e}"[:200])


async def probe_loop(base: str, model: str, stop_at: float, every: float, max_tokens: int, stats: dict) -> None:
    """Every `every` seconds while the soak runs, the same greedy request (fixed prompt, temperature 0, EOS
    ignored so that it is always `max_tokens` long): its text must equal the first probe's. A different answer
    under load means one sequence's state leaked into another's (KV pages, preemption, batching). With random
    weights the answer is one prompt-dependent token repeated, so the text alone catches only gross corruption: the
    largest change of a probe token's logprob from the first probe's is reported beside it (batches of other sizes
    round differently, so it is a diagnostic, not a pass condition), and the first probe's smallest margin between
    its top two candidates (random logits are close: a mismatch at a token whose margin is below the drift may be
    rounding rather than a leak; each mismatch sample says where it diverged and that token's margin)."""
    import openai

    messages = [{"role": "user", "content": "List the planets of the solar system in order, with one fact each."}]
    first: list = []
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300) as client:
        next_at = time.monotonic()
        while next_at < stop_at:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += every
            try:
                r = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                         temperature=0, logprobs=True, top_logprobs=2,
                                                         extra_body={"ignore_eos": True})
            except Exception as e:  # noqa: BLE001 - counted, reported
                stats["probe_errors"] += 1
                count_error(stats, e)
                continue
            text = r.choices[0].message.content or ""
            tokens = r.choices[0].logprobs.content or []
            stats["probes"] += 1
            if stats["probe_text"] is None:
                stats["probe_text"], first = text, tokens
                # how far apart the first probe's top two candidates were: a later probe whose text differs
                # where this margin is below its logprob drift may be rounding, not corruption
                margins = [t.top_logprobs[0].logprob - t.top_logprobs[1].logprob for t in tokens
                           if len(t.top_logprobs) > 1]
                stats["probe_min_top2_margin"] = round(min(margins), 5) if margins else None
            elif text != stats["probe_text"]:
                stats["probe_mismatches"] += 1
                at = next((i for i, (x, y) in enumerate(zip(tokens, first)) if x.token != y.token),
                          min(len(tokens), len(first)))
                margin = (first[at].top_logprobs[0].logprob - first[at].top_logprobs[1].logprob
                          if at < len(first) and len(first[at].top_logprobs) > 1 else None)
                stats["probe_mismatch_samples"] = (stats["probe_mismatch_samples"] + [
                    {"text": text, "first_different_token": at, "first_probe_top2_margin_there": margin}])[:3]
            else:
                drift = max((abs(x.logprob - y.logprob) for x, y in zip(tokens, first)), default=0.0)
                stats["probe_logprob_max_drift"] = max(stats["probe_logprob_max_drift"], round(drift, 5))


def soak(base: str, seconds: int, clients: int, probe_every: float = 10.0, probe_tokens: int = 32) -> dict:
    import httpx

    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    stats = {"completed": 0, "disconnects": 0, "errors": 0, "http_5xx": 0, "chunks": 0, "error_samples": set(),
             "probes": 0, "probe_mismatches": 0, "probe_errors": 0, "probe_text": None, "probe_mismatch_samples": [],
             "probe_logprob_max_drift": 0.0, "probe_min_top2_margin": None}
    stop_at = time.monotonic() + seconds
    tokens_before = metric(base, "mlcc_generation_tokens_total")
    server_5xx_before = server_5xx(base)

    async def run():
        await asyncio.gather(probe_loop(base, model, stop_at, probe_every, probe_tokens, stats),
                             *[client_loop(base, model, stop_at, random.Random(i), stats) for i in range(clients)])

    t = time.monotonic()
    asyncio.run(run())
    wall = time.monotonic() - t
    # every client has its answer or has hung up; an aborted request's pages are freed by the engine's next step
    for _ in range(300):
        if metric(base, "mlcc_running_requests") == 0 and metric(base, "mlcc_kv_pages_used") == 0:
            break
        time.sleep(0.1)
    stats.update(wall_s=round(wall, 1), clients=clients, pages_used_after=metric(base, "mlcc_kv_pages_used"),
                 aborted_seen_by_server=metric(base, "mlcc_requests_aborted_total"),
                 server_5xx_responses=server_5xx(base) - server_5xx_before,
                 generated_tokens=metric(base, "mlcc_generation_tokens_total") - tokens_before,
                 server_alive=httpx.get(f"{base}/health").status_code == 200)
    stats["streamed_tok_s"] = round(stats["generated_tokens"] / wall, 1)
    stats["error_samples"] = sorted(stats["error_samples"])[:5]
    stats["pass"] = (stats["errors"] == 0 and stats["http_5xx"] == 0 and stats["server_5xx_responses"] == 0
                     and stats["probes"] > 0 and stats["probe_mismatches"] == 0 and stats["pages_used_after"] == 0
                     and stats["server_alive"])
    return stats


def latency_summary(rows: list[dict]) -> list[dict]:
    """TTFT and inter-token latency p50/p99 (ms) of each sweep rate."""
    return [{"rate": r["rate"], "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
             "itl_p50_ms": r["itl_ms"]["p50"], "itl_p99_ms": r["itl_ms"]["p99"], "output_tok_s": r["output_tok_s"],
             "errors": r["errors"]} for r in rows]


def batched_throughput(a, n_prompts: int = 256, new_tokens: int = 128) -> dict:
    """The same prompts, all submitted at once: mlcc's Engine (max_batch 64) vs transformers generate_batch."""
    import concurrent.futures as cf

    from mlcc.runtime.engine import Engine

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 128))) for _ in range(n_prompts)]
    out = {"prompts": n_prompts, "new_tokens": new_tokens}
    with Engine(a.model, target=a.target, max_batch=64) as e:
        e.completions.create(prompt="warm up", max_tokens=4)
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(n_prompts) as ex:
            res = list(ex.map(lambda p: e.completions.create(prompt=p, max_tokens=new_tokens, temperature=0,
                                                             ignore_eos=True), prompts))
        dt = time.perf_counter() - t
        ids = [e.encode_prompt(p) for p in prompts]
    out["mlcc_tok_s"] = sum(r.usage.completion_tokens for r in res) / dt
    hf = _hf_generate_batch("smollm2-135m", ids, new_tokens)
    if hf["transformers_tok_s"] is None:
        out["hf_error"] = hf["transformers_error"]
    else:
        out["hf_generate_batch_tok_s"], out["transformers"] = hf["transformers_tok_s"], hf["transformers"]
    return out


def cmd_http(a) -> None:
    from mlcc.runtime.serve.loadgen import wait_until_healthy

    Path(a.out).mkdir(parents=True, exist_ok=True)
    res: dict = {"build": build_info(), "model": a.model or "bundled default", "weights": a.weights,
                 "target": a.target, "load_before": _loadavg()}
    proc, base = start_server(a)
    try:
        wait_until_healthy(base, proc, timeout=900)
        res["sweep"] = sweep(base, a)
        res["latency"] = latency_summary(res["sweep"])
        write_json(a.out, "serve.json", res)
        if a.soak_seconds:
            res["soak"] = soak(base, a.soak_seconds, a.soak_clients, a.probe_every, a.probe_tokens)
            print(json.dumps(res["soak"], indent=1), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if a.prefix_ab:
        proc, base = start_server(a, ("--no-prefix-cache",))
        try:
            wait_until_healthy(base, proc, timeout=900)
            res["sweep_no_prefix_cache"] = sweep(base, a)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if a.batched:
        res["batched"] = batched_throughput(a)
        print(json.dumps(res["batched"], indent=1))
    res["load_after"] = _loadavg()
    res["pass"] = res.get("soak", {"pass": True})["pass"] and \
        not any(r["errors"] for r in res["sweep"] + res.get("sweep_no_prefix_cache", []))
    write_json(a.out, "serve.json", res)
    for r in res["latency"]:
        print(f"rate {r['rate']}: TTFT p50 {r['ttft_p50_ms']} / p99 {r['ttft_p99_ms']} ms, ITL p50 "
              f"{r['itl_p50_ms']} / p99 {r['itl_p99_ms']} ms, {r['output_tok_s']} tok/s, {r['errors']} errors")
    if "soak" in res:
        k = res["soak"]
        print(f"soak {k['wall_s']} s x {k['clients']} clients: {k['completed']} completed, {k['disconnects']} "
              f"disconnected, {k['errors']} errors, {k['http_5xx']} 5xx (server: {k['server_5xx_responses']:.0f}), "
              f"probes {k['probes']} ({k['probe_mismatches']} mismatched), KV pages after "
              f"{k['pages_used_after']:.0f}, server alive {k['server_alive']}: {'PASS' if k['pass'] else 'FAIL'}")
    print("PASS" if res["pass"] else "FAIL", flush=True)
    if not res["pass"]:
        sys.exit(1)


# --- the prefix cache in one process --------------------------------------------------------------------------------

SYSTEM_WORDS = ("You are a careful assistant for a hardware store. Answer briefly, cite the aisle, never invent "
                "stock levels, and ask one question when a request is ambiguous.").split()


def _loadavg() -> float:
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


def cmd_prefix_cpu(a) -> None:
    from mlcc import Engine

    res: dict = {"build": build_info(), "load_before": _loadavg(), "system_tokens": a.system_tokens}
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
    res["load_after"] = _loadavg()
    print(write_json(a.out, "prefix_cache_cpu.json", res))


def _run_prefix_load(core, prompts: list[list[int]], gaps: list[float], output_len: int) -> dict:
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


def cmd_prefix_load(a) -> None:
    from mlcc.options import EngineConfig
    from mlcc.runtime.core.sampler import Sampler
    from mlcc.runtime.device.model import LoadedModel
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
                 "max_batch": a.max_batch, "kv_tokens": kv_tokens, "policy": a.policy, "load_before": _loadavg()}
    for name, on in (("cache_on", True), ("cache_off", False)):
        config = EngineConfig(max_batch=a.max_batch, kv_cache_tokens=kv_tokens, prefill_chunk=a.prefill_chunk,
                              policy=a.policy, prefix_cache=on)
        core = EngineCore(model, Sampler.for_model(model), config)
        try:
            _run_prefix_load(core, [prompts[0]], [0.0], 4)   # warm-up (and, with the cache, the shared prefix cached)
            core.stats.clear()
            res[name] = _run_prefix_load(core, prompts, gaps, a.output_len)
        finally:
            core.shutdown()
        r = res[name]
        print(f"{name}: {r['output_tok_s']} tok/s, TTFT p50 {r['ttft_ms']['p50']} ms p99 {r['ttft_ms']['p99']} ms, "
              f"hit rate {r['token_hit_rate']}", flush=True)
    res["throughput_ratio"] = round(res["cache_on"]["output_tok_s"] / res["cache_off"]["output_tok_s"], 2)
    res["load_after"] = _loadavg()
    print(write_json(a.out, "prefix_cache_load.json", res))


def _http_args(p) -> None:
    p.add_argument("--model", default=None, help="artifacts folder, HF folder or .gguf (default: the bundled model)")
    p.add_argument("--target", default="cuda")
    p.add_argument("--rates", default="1,2,4,8,16", help="comma-separated request rates (req/s); empty: no sweep")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--input-len", default="uniform:64:256", help="words per prompt: N or uniform:A:B")
    p.add_argument("--output-len", default="128", help="tokens per answer: N or uniform:A:B")
    p.add_argument("--soak-seconds", type=int, default=180, help="0: no soak")
    p.add_argument("--soak-clients", type=int, default=64)
    p.add_argument("--probe-every", type=float, default=10.0, help="seconds between the soak's greedy probes")
    p.add_argument("--probe-tokens", type=int, default=32, help="tokens each greedy probe generates")
    p.add_argument("--weights", default="files", choices=["files", "random"],
                   help="random: the server fills the weights with random values (`build`'s shape-only folders)")
    p.add_argument("--batched", action="store_true", help="also batched throughput against transformers (CUDA)")
    p.add_argument("--shared-prefix", type=float, default=0.0, help="fraction of each sweep prompt shared by all")
    p.add_argument("--prefix-ab", action="store_true", help="the sweep again on a server without the prefix cache")
    p.add_argument("--out", required=True)


def cmd_build(a) -> None:
    from mlcc.options import CompileOptions

    r = build_shape_with_tokenizer(a.shape, a.quant, a.target, a.out, a.tokenizer_gguf, a.layers,
                                   options=CompileOptions.parse(a.option) if a.option else None)
    print(json.dumps(r, indent=1))


def _build_args(p) -> None:
    p.add_argument("--out", required=True, help="the artifacts folder to write (replaced if it exists)")
    p.add_argument("--shape", default="llama3-8b", help="a preset of mlcc.relax_models.presets")
    p.add_argument("--quant", default="q4f16_1")
    p.add_argument("--target", default="cuda")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--tokenizer-gguf", default=None, help="default: the bundled SmolLM2-135M-Instruct's")
    add_options_argument(p)


def _prefix_cpu_args(p) -> None:
    p.add_argument("--system-tokens", type=int, default=1200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--out", required=True)


def _prefix_load_args(p) -> None:
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


def _hf_generate_batch(model: str, prompts: list[list[int]], output_len: int) -> dict:
    """transformers' continuous batching (`generate_batch`, fp16, sdpa) on the preset's shape with random weights:
    output tok/s over `prompts` (token ids), or the error."""
    try:
        import torch
        import transformers as tf

        with torch.device("cuda"):
            hf = tf.LlamaForCausalLM(tf.LlamaConfig(**presets()[model].hf_config())).to(torch.float16).eval()
        gc = tf.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            hf.generate_batch(inputs=prompts[:4], generation_config=gc)
            t = time.perf_counter()
            r = hf.generate_batch(inputs=prompts, generation_config=gc)
            dt = time.perf_counter() - t
        del hf
        torch.cuda.empty_cache()
        return {"transformers_tok_s": round(sum(len(v.generated_tokens) for v in r.values()) / dt, 1),
                "transformers": tf.__version__}
    except Exception as e:  # noqa: BLE001 - the comparison is reported as missing, not silently dropped
        return {"transformers_tok_s": None, "transformers_error": f"{type(e).__name__}: {e}"[:300]}


def cmd_throughput(a) -> None:
    """`mlcc bench throughput` for each --quants build in --libs and each --shapes input/output pair, one process a
    row (an engine keeps its GPU memory until its process ends), then transformers generate_batch on --hf-shapes;
    rows appended to OUT/throughput.json as they come."""
    device = device_name()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "throughput_rows.json"
    shapes = [tuple(int(x) for x in s.split("/")) for s in a.shapes.split(",")]
    for quant in a.quants.split(","):
        for input_len, output_len in shapes:
            requests = a.requests if input_len + output_len <= 1024 else a.long_requests
            cmd = [sys.executable, "-m", "mlcc", "bench", "throughput", str(Path(a.libs) / f"{a.model}-{quant}"),
                   "--target", "cuda", "--weights", "random", "--max-batch", str(a.max_batch), "--no-prefix-cache",
                   "--input-len", str(input_len), "--output-len", str(output_len), "--num-requests", str(requests),
                   "--context-window", str(input_len + output_len + 16), "--json", str(rows_file)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            print(r.stdout.strip()[-600:] or r.stderr.strip()[-1500:], flush=True)
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    hf = {}
    for spec in filter(None, a.hf_shapes.split(",")):
        input_len, output_len = (int(x) for x in spec.split("/"))
        from mlcc.runtime.serve.throughput import synthetic_prompts

        vocab = presets()[a.model].hf_config()["vocab_size"]
        hf[spec] = _hf_generate_batch(a.model, synthetic_prompts(vocab, a.requests, input_len), output_len)
        print(spec, hf[spec], flush=True)
    for row in rows:
        row.update({"bench": "throughput", "device": device, "model": a.model, "mlcc_tok_s": row["output_tok_s"]})
        row.update(hf.get(f"{row['input_len']}/{row['output_len']}", {"transformers_tok_s": None}))
    print(write_json(a.out, "throughput.json", {"build": build_info(), "rows": rows}))


def _throughput_args(p) -> None:
    p.add_argument("--libs", required=True, help="folder of shape-only CUDA builds (bench/decode.py build)")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--quants", default="q4f16_1,q0f16")
    p.add_argument("--shapes", default="128/128,1000/1000", help="input/output token pairs")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--long-requests", type=int, default=256, help="requests of shapes over 1,024 tokens")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--hf-shapes", default="128/128", help="shapes transformers generate_batch runs too")
    p.add_argument("--out", required=True)


if __name__ == "__main__":
    cli(__doc__, {"build": (cmd_build, _build_args), "http": (cmd_http, _http_args), "prefix-cpu": (cmd_prefix_cpu, _prefix_cpu_args),
                  "prefix-load": (cmd_prefix_load, _prefix_load_args),
                  "throughput": (cmd_throughput, _throughput_args)})

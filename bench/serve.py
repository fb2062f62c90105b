"""`mlcc serve` under load, one server per run: TTFT and inter-token latency percentiles over a request-rate sweep,
then a soak with client disconnects, then (optionally) batched throughput against transformers.

    python3 bench/serve.py --model DIR --target cuda --out $OUT          # device (bench/gpu.sh run ...)
    python bench/serve.py --target llvm --rates 0.5,1 --num-prompts 8 --output-len 16 --soak-seconds 20 \
        --soak-clients 4 --out /tmp/serve                                # this CPU, the bundled SmolLM2

1. Sweep: open-loop Poisson arrivals at each --rates value (mlcc.runtime.serve.loadgen, what `mlcc bench` runs),
   streaming completions with a fixed output length (EOS ignored); per rate TTFT and ITL p50/p90/p99 (ms), output
   tok/s, errors.
2. Soak: --soak-clients concurrent streaming chat clients for --soak-seconds, random prompts and lengths, 20% of
   the requests disconnecting after 1-20 chunks. Pass: 0 client errors (a disconnect we caused is not one), 0 KV
   pages in use once idle, the server alive.
3. --batched: the same 256 prompts x 128 new tokens submitted at once to mlcc's Engine (max_batch 64) and to
   transformers' continuous batching (`generate_batch`, fp16, the SmolLM2 shape with random weights; CUDA only).
--shared-prefix F: that fraction of every sweep prompt is the same for all requests (a common system prompt); with
--prefix-ab the sweep runs twice, on a server with the prefix cache (the default) and on one started with
--no-prefix-cache, same prompts and arrivals (rows "sweep" and "sweep_no_prefix_cache"); for shape-only builds
(no tokenizer) bench/prefix_cache.py load runs the same comparison in one process:

    python3 bench/serve.py --model DIR --target cuda --shared-prefix 0.9 --input-len 800 --prefix-ab \
        --soak-seconds 0 --out $OUT
The server runs with --max-batch = max(--soak-clients, 8) and the max_util policy (preempt and recompute).
Writes serve.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness import presets, write_json

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def metric(base: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def start_server(a, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlcc", "serve", *([a.model] if a.model else []), "--target", a.target,
           "--port", str(port), "--max-batch", str(max(a.soak_clients, 8)), "--policy", "max_util", *extra]
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
                stats["errors"] += 1
                stats["error_samples"].add(f"{type(e).__name__}: {e}"[:200])


def soak(base: str, seconds: int, clients: int) -> dict:
    import httpx

    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    stats = {"completed": 0, "disconnects": 0, "errors": 0, "chunks": 0, "error_samples": set()}
    stop_at = time.monotonic() + seconds
    tokens_before = metric(base, "mlcc_generation_tokens_total")

    async def run():
        await asyncio.gather(*[client_loop(base, model, stop_at, random.Random(i), stats) for i in range(clients)])

    t = time.monotonic()
    asyncio.run(run())
    wall = time.monotonic() - t
    for _ in range(100):
        if metric(base, "mlcc_running_requests") == 0:
            break
        time.sleep(0.1)
    stats.update(wall_s=round(wall, 1), clients=clients, pages_used_after=metric(base, "mlcc_kv_pages_used"),
                 aborted_seen_by_server=metric(base, "mlcc_requests_aborted_total"),
                 generated_tokens=metric(base, "mlcc_generation_tokens_total") - tokens_before,
                 server_alive=httpx.get(f"{base}/health").status_code == 200)
    stats["streamed_tok_s"] = round(stats["generated_tokens"] / wall, 1)
    stats["error_samples"] = sorted(stats["error_samples"])[:5]
    stats["pass"] = stats["errors"] == 0 and stats["pages_used_after"] == 0 and stats["server_alive"]
    return stats


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
    try:
        import torch
        import transformers as tf

        with torch.device("cuda"):
            hf = tf.LlamaForCausalLM(tf.LlamaConfig(**presets()["smollm2-135m"].config)).to(torch.float16).eval()
        gc = tf.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            hf.generate_batch(inputs=ids[:4], generation_config=gc)
            t = time.perf_counter()
            r = hf.generate_batch(inputs=ids, generation_config=gc)
            dt = time.perf_counter() - t
        out["hf_generate_batch_tok_s"] = sum(len(v.generated_tokens) for v in r.values()) / dt
        out["transformers"] = tf.__version__
    except Exception as e:  # noqa: BLE001 - the comparison is reported as missing, not silently dropped
        out["hf_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="artifacts folder, HF folder or .gguf (default: the bundled model)")
    p.add_argument("--target", default="cuda")
    p.add_argument("--rates", default="1,2,4,8,16", help="comma-separated request rates (req/s); empty: no sweep")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--input-len", default="uniform:64:256", help="words per prompt: N or uniform:A:B")
    p.add_argument("--output-len", default="128", help="tokens per answer: N or uniform:A:B")
    p.add_argument("--soak-seconds", type=int, default=180, help="0: no soak")
    p.add_argument("--soak-clients", type=int, default=64)
    p.add_argument("--batched", action="store_true", help="also batched throughput against transformers (CUDA)")
    p.add_argument("--shared-prefix", type=float, default=0.0, help="fraction of each sweep prompt shared by all")
    p.add_argument("--prefix-ab", action="store_true", help="the sweep again on a server without the prefix cache")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    from mlcc.runtime.serve.loadgen import wait_until_healthy

    Path(a.out).mkdir(parents=True, exist_ok=True)
    res: dict = {"model": a.model or "bundled default", "target": a.target}
    proc, base = start_server(a)
    try:
        wait_until_healthy(base, proc, timeout=900)
        res["sweep"] = sweep(base, a)
        write_json(a.out, "serve.json", res)
        if a.soak_seconds:
            res["soak"] = soak(base, a.soak_seconds, a.soak_clients)
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
    write_json(a.out, "serve.json", res)
    if not res.get("soak", {"pass": True})["pass"] or \
            any(r["errors"] for r in res["sweep"] + res.get("sweep_no_prefix_cache", [])):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Serving soak on the GPU (issue 5): 64 concurrent streaming clients with random disconnects against `mlcc serve`,
then batched throughput of the same prompts through mlcc's engine and transformers' continuous batching.

    python3 bench/soak.py --model DIR --seconds 180 --out $OUT

Pass: 0 client errors (a disconnect we caused is not an error), 0 KV pages in use once idle, server alive.
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

import httpx

from mlcc.runtime.loadgen import wait_until_healthy

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


async def client_loop(base: str, model: str, stop_at: float, rng: random.Random, stats: dict) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    while time.monotonic() < stop_at:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200)))
        max_tokens = rng.randint(16, 160)
        cut = rng.randint(1, 20) if rng.random() < 0.2 else None
        try:
            stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                          max_tokens=max_tokens, temperature=0.7, stream=True)
            n = 0
            async for chunk in stream:
                n += 1
                if cut is not None and n >= cut:
                    await stream.close()  # simulated client disconnect
                    stats["disconnects"] += 1
                    break
            else:
                stats["completed"] += 1
            stats["chunks"] += n
        except Exception as e:  # noqa: BLE001 - counted, reported
            stats["errors"] += 1
            stats["error_samples"].add(f"{type(e).__name__}: {e}"[:200])


def soak(model_dir: str, seconds: int, clients: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "mlcc", "serve", model_dir, "--target", "cuda", "--port", str(port),
                             "--max-batch", str(clients), "--policy", "max_util"],
                            stdout=subprocess.DEVNULL, stderr=open("/tmp/soak-server.log", "w"))
    try:
        wait_until_healthy(base, proc, timeout=600)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        stats = {"completed": 0, "disconnects": 0, "errors": 0, "chunks": 0, "error_samples": set()}
        stop_at = time.monotonic() + seconds

        async def main():
            await asyncio.gather(*[client_loop(base, model, stop_at, random.Random(i), stats) for i in range(clients)])

        t = time.monotonic()
        asyncio.run(main())
        wall = time.monotonic() - t
        for _ in range(100):
            if metric(base, "mlcc_running_requests") == 0:
                break
            time.sleep(0.1)
        stats.update(wall_s=round(wall, 1), clients=clients, pages_used_after=metric(base, "mlcc_kv_pages_used"),
                     aborted_seen_by_server=metric(base, "mlcc_requests_aborted_total"),
                     generated_tokens=metric(base, "mlcc_generation_tokens_total"),
                     server_alive=httpx.get(f"{base}/health").status_code == 200)
        stats["streamed_tok_s"] = round(stats["generated_tokens"] / wall, 1)
        stats["error_samples"] = sorted(stats["error_samples"])[:5]
        stats["pass"] = stats["errors"] == 0 and stats["pages_used_after"] == 0 and stats["server_alive"]
        return stats
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def batched_throughput(model_dir: str, n_prompts: int, new_tokens: int) -> dict:
    """Same prompts, all submitted at once: mlcc Engine (max_batch 64) vs transformers generate_batch."""
    import concurrent.futures as cf

    from mlcc.runtime.engine import Engine

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 128))) for _ in range(n_prompts)]
    out = {}
    with Engine(model_dir, target="cuda", max_batch=64) as e:
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

        from decode import SMOLLM2_135M

        with torch.device("cuda"):
            hf = tf.LlamaForCausalLM(tf.LlamaConfig(**SMOLLM2_135M)).to(torch.float16).eval()
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
    out.update(prompts=n_prompts, new_tokens=new_tokens)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--seconds", type=int, default=180)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    res = {"soak": soak(a.model, a.seconds, a.clients)}
    print(json.dumps(res["soak"], indent=1), flush=True)
    res["batched"] = batched_throughput(a.model, 256, 128)
    print(json.dumps(res["batched"], indent=1))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "soak.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

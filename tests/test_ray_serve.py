"""`mlcc serve --ray`: a local Ray cluster, two engine replicas on the CPU (one CPU slot each) behind Ray Serve's
HTTP ingress, driven by the official openai client: chat and streams, concurrent load, prefix-aware routing, and a
replica killed mid-load.

The CI's tests use the tiny test Llama (a replica loads in seconds); the bundled SmolLM2 (compiled on first use,
minutes) is the `slow` test at the end."""

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from server_support import free_port, wait_for

from mlcc.runtime.serve.loadgen import wait_until_healthy

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'mlcc[ray]'")

ENGINE_REPLICA = "ServeReplica:mlcc:MlccEngine"   # the process title of an engine replica


def _replica_pids(server: subprocess.Popen) -> list[int]:
    """The engine replicas' processes (workers of the local cluster that `server` started)."""
    pids = []
    for p in psutil.Process(server.pid).children(recursive=True):
        try:
            if ENGINE_REPLICA in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return sorted(pids)


def _metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


@contextlib.contextmanager
def ray_serve(model, log: Path, *args: str):
    """`mlcc serve MODEL --ray` on a local cluster of its own; yields (base URL, process). Stopped by SIGTERM, after
    which none of its replicas may be left running."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlcc", "serve", *([str(model)] if model else []), "--target", "llvm", "--ray",
           "--ray-address", "local", "--replicas", "2", "--num-cpus-per-replica", "1", "--max-batch", "4",
           "--port", str(port), *args]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(base, proc, timeout=900)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(log.read_text()[-5000:]) from e
        yield base, proc
    finally:
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            for p in children:   # a local cluster's processes go with it; make sure, without a global kill
                try:
                    p.kill()
                except psutil.Error:
                    pass


@pytest.fixture(scope="module")
def server(compiled, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    with ray_serve(compiled("llama", "q0f32"), log, "--served-model-name", "tiny") as (base, proc):
        assert wait_for(lambda: len(_replica_pids(proc)) == 2, 60), log.read_text()[-3000:]
        yield base, proc


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=120)


MSGS = [{"role": "user", "content": "Hello there"}]


def test_chat_and_stream_through_the_ingress(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):   # the replicas' own checks answer, in OpenAI's shape
        client.chat.completions.create(model="gpt-17", messages=MSGS, max_tokens=2)


def test_sixteen_concurrent_requests_all_succeed(server):
    aclient = openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=120)

    async def one(i: int) -> int:
        prompt = f"request {i}: " + "count the words " * (i % 4)
        if i % 2:
            r = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                 extra_body={"ignore_eos": True})
            return r.usage.completion_tokens
        n = 0
        async for c in await aclient.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            n = c.usage.completion_tokens if c.usage else n
        return n

    async def main():
        return await asyncio.gather(*[one(i) for i in range(16)])

    assert asyncio.run(main()) == [16] * 16


def test_a_shared_prefix_goes_to_the_replica_that_caches_it(server, client):
    base, _ = server
    system = {"role": "system", "content": "You are a terse assistant. Answer in one word only. " * 6}
    first = client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": "A?"}],
                                           max_tokens=4, temperature=0)
    before = _metrics(base)
    second = client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": "B?"}],
                                            max_tokens=4, temperature=0)
    after = _metrics(base)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # one token per byte here: the whole system prompt came from that replica's prefix cache
    assert second.usage.prompt_tokens_details.cached_tokens >= len(system["content"])
    key = 'mlcc_router_requests_total{decision="prefix"}'
    assert after[key] == before.get(key, 0) + 1
    assert 0 < after["mlcc_router_prefix_hit_rate"] <= 1


def test_metrics_show_each_replicas_load(server):
    base, _ = server
    assert wait_for(lambda: sum(k.startswith("mlcc_replica_kv_pages_total{") for k in _metrics(base)) == 2, 30)
    rows = _metrics(base)
    assert sum(k.startswith("mlcc_replica_ongoing_requests{") for k in rows) == 2
    assert sum(k.startswith("mlcc_replica_prefix_cache_hit_rate{") for k in rows) == 2


def _stream(client, i: int) -> tuple[int, str | None]:
    tokens = 0
    try:
        for c in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"s{i}"}],
                                                max_tokens=450, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
            tokens = c.usage.completion_tokens if c.usage else tokens
        return tokens, None
    except openai.APIError as e:
        return tokens, str(e)


def _plain(client, i: int) -> tuple[int, str | None]:
    try:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"p{i}"}],
                                           max_tokens=450, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens, None
    except openai.APIError as e:
        return 0, str(e)


def test_a_replica_killed_mid_load_is_restarted_and_nothing_hangs(server, client):
    """SIGKILL to one replica's process while eight requests run on the two: streams on it end with an error
    naming the cause, non-streamed ones (nothing sent yet) are retried on the other, Ray Serve starts a new
    replica, and later requests succeed."""
    base, proc = server
    victim = _replica_pids(proc)[0]
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_stream, client, i) for i in range(4)] + [pool.submit(_plain, client, i)
                                                                          for i in range(4)]
        assert wait_for(lambda: sum(v for k, v in _metrics(base).items()
                                 if k.startswith("mlcc_replica_ongoing_requests{")) >= 2, 30)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
    assert time.monotonic() - t0 < 120
    streams, plain = results[:4], results[4:]
    assert plain == [(450, None)] * 4, plain
    for tokens, error in streams:
        assert error is None and tokens == 450 or "engine replica serving this stream died" in error, streams
    assert wait_for(lambda: len(_replica_pids(proc)) == 2 and victim not in _replica_pids(proc), 120)
    for i in range(4):
        assert client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4).usage.completion_tokens


@pytest.mark.slow
def test_two_replicas_of_the_default_model(tmp_path):
    """The bundled SmolLM2-135M-Instruct (compiled on first use, once for both replicas)."""
    with ray_serve(None, tmp_path / "serve.log") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(messages=ask, model=client.models.list().data[0].id, max_tokens=16,
                                           temperature=0)
        assert "Paris" in r.choices[0].message.content
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            messages=ask, model=r.model, max_tokens=16, temperature=0, stream=True) if c.choices)
        assert text == r.choices[0].message.content

"""How `mlcc serve` ends requests other than by finishing them: a client that goes away (streamed or not), SIGTERM
(drain: 503 for new requests, a grace period for running ones, then abort), KV-cache exhaustion at max batch
(preemption, not an error), and a failed engine step (500 naming the cause, /health 503, nothing more admitted).

The tiny test Llama decodes 1,000-3,000 tokens a second here: requests of 2,000 tokens (its 2k-window variant) run
long enough to be caught running."""

import concurrent.futures
import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_support import free_port, mlcc_serve, wait_for

from mlcc.runtime.serve.loadgen import wait_until_healthy

LONG = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000, "ignore_eos": True}


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def model(compiled):
    return compiled("llama_2k", "q0f32")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """max_util over 128 KV pages: four long requests at once do not fit, one does."""
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with mlcc_serve(model, log, "--max-batch", "4", "--policy", "max_util", "--kv-cache-tokens", "2048",
                    "--served-model-name", "tiny") as base:
        yield base


def test_a_non_streamed_request_is_aborted_when_its_client_goes_away(server):
    aborted = _metric(server, "mlcc_requests_aborted_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/chat/completions", json=LONG, timeout=httpx.Timeout(30, read=0.2))
    assert wait_for(lambda: _metric(server, "mlcc_running_requests") == 0, timeout=5)
    assert _metric(server, "mlcc_requests_aborted_total") == aborted + 1   # aborted, not run to max_tokens
    assert _metric(server, "mlcc_kv_pages_used") == 0


def test_kv_exhaustion_at_max_batch_preempts_instead_of_failing(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    before = _metric(server, "mlcc_requests_preempted")

    def one(i: int):
        return client.completions.create(model="tiny", prompt=f"request {i} " * 3, max_tokens=1000, temperature=0,
                                         extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert [r.usage.completion_tokens for r in results] == [1000] * 4
    assert _metric(server, "mlcc_requests_preempted") > before


def _start(model, log, *args):
    port = free_port()
    with open(log, "w") as out:   # the child keeps its own descriptor
        # one thread, one request at a time: the 2,000-token requests outlast the checks made while they run
        proc = subprocess.Popen([sys.executable, "-m", "mlcc", "serve", str(model), "--target", "llvm", "--port",
                                 str(port), "--max-batch", "1", "--threads", "1", *args],
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(base, proc)
    return proc, base


def _stream_lines(base: str, body: dict, first: concurrent.futures.Future) -> list[str]:
    lines = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if not first.done():
                    first.set_result(True)
    return lines


def _one_running_one_queued(pool, base: str):
    """A long stream that has started and a long non-streamed request queued behind it (max batch 1): futures of
    the stream's lines and of the other's response."""
    first = concurrent.futures.Future()
    streamed = pool.submit(_stream_lines, base, LONG, first)
    first.result(timeout=30)
    queued = pool.submit(httpx.post, f"{base}/v1/chat/completions", json=LONG, timeout=60)
    assert wait_for(lambda: _metric(base, "mlcc_queue_length") == 1)
    return streamed, queued


def test_sigterm_refuses_new_requests_and_lets_running_ones_finish(model, tmp_path):
    proc, base = _start(model, tmp_path / "server.log", "--shutdown-grace-seconds", "60")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streamed, queued = _one_running_one_queued(pool, base)
            proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: httpx.get(f"{base}/health").status_code == 503)
            assert httpx.get(f"{base}/health").json() == {"status": "draining"}
            refused = httpx.post(f"{base}/v1/chat/completions", json={**LONG, "max_tokens": 2})
            assert refused.status_code == 503
            assert "shutting down and admits no new requests" in refused.json()["error"]["message"]
            lines = streamed.result(timeout=60)
            assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines)
            assert queued.result(timeout=60).json()["usage"]["completion_tokens"] == 2000
        proc.wait(timeout=30)   # drained well within the grace period
    finally:
        proc.kill()
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_sigterm_aborts_what_is_still_running_after_the_grace_period(model, tmp_path):
    proc, base = _start(model, tmp_path / "server.log", "--shutdown-grace-seconds", "0.1")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streamed, queued = _one_running_one_queued(pool, base)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            lines = streamed.result(timeout=30)
            err = json.loads(lines[-1].removeprefix("data: "))["error"]
            assert "grace period and was aborted" in err["message"]
            late = queued.result(timeout=30)
            assert late.status_code == 503 and "grace period" in late.json()["error"]["message"]
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 15   # nothing hung
    finally:
        proc.kill()


def test_a_failed_engine_step_fails_its_requests_and_marks_the_server_unhealthy(model, monkeypatch):
    """A device fault, simulated by a prefill that raises: the request gets a 500 naming it, /health turns 503
    and new requests are refused instead of failing one by one."""
    from fastapi.testclient import TestClient

    from mlcc.runtime.engine import Engine
    from mlcc.runtime.serve.server import create_app

    with Engine(model, target="llvm", max_batch=2) as engine:
        def faulty_prefill(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(engine.model, "prefill", faulty_prefill)
        with TestClient(create_app(engine)) as http:
            assert http.get("/health").status_code == 200
            r = http.post("/v1/chat/completions", json={**LONG, "max_tokens": 4})
            assert r.status_code == 500
            assert r.json()["error"]["message"] == ("generation failed: RuntimeError: CUDA error: an illegal memory "
                                                    "access was encountered")
            health = http.get("/health")
            assert health.status_code == 503 and "illegal memory access" in health.json()["reason"]
            again = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            assert again.status_code == 503 and "must be restarted" in again.json()["error"]["message"]
            assert http.get("/metrics").status_code == 200

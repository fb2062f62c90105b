"""Prefix caching on CUDA (the tiny Llama, q4f16_1): greedy outputs equal the engine's with the cache off; a chat's
next turn continues the previous turn's sequence and still decodes through decode_graph (one block of pages); a
fork (another question after the same prefix) and concurrent requests stay exact.

MLCC_CUDA_MODEL=DIR uses a CUDA build made elsewhere (a runtime-only TVM cannot compile one); otherwise the test
compiles it (full TVM)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest


def _cuda_present() -> bool:
    import tvm

    from mlcc import tvm_compat

    tvm_compat.load_backend_runtimes("cuda")
    return tvm.cuda(0).exist


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    if os.environ.get("MLCC_CUDA_MODEL"):
        return Path(os.environ["MLCC_CUDA_MODEL"])
    from conftest import make_hf_model

    from mlcc.compiler.build import compile_model

    root = tmp_path_factory.mktemp("gpu-prefix")
    compile_model(make_hf_model("llama", root / "hf"), "cuda", "q4f16_1", root / "cuda")
    return root / "cuda"


def _greedy(engine, prompt: list[int], new: int = 24) -> tuple[str, int]:
    r = engine.completions.create(prompt=prompt, max_tokens=new, temperature=0, ignore_eos=True)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def _concurrently(engine, prompts: list[list[int]]) -> list[str]:
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _greedy(engine, prompts[i])[0]))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [got[i] for i in range(len(prompts))]


def test_prefix_cache_on_cuda(build):
    from mlcc import Engine

    with Engine(build, target="cuda", max_batch=4, prefix_cache=False) as cold, \
            Engine(build, target="cuda", max_batch=4) as warm:
        graph = warm.model.graph
        assert graph is not None
        calls = [0]
        fn = graph.fn

        def counted(*args):
            calls[0] += 1
            return fn(*args)

        graph.fn = counted
        messages = [{"role": "system", "content": "Answer briefly. " * 8}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"question {turn}?"})
            kw = dict(messages=messages, max_tokens=24, temperature=0, ignore_eos=True)
            want = cold.chat.completions.create(**kw).choices[0].message.content
            before = calls[0]
            r = warm.chat.completions.create(**kw)
            assert r.choices[0].message.content == want, turn
            assert (r.usage.prompt_tokens_details.cached_tokens > 0) == (turn > 0)
            assert calls[0] - before >= 10, turn   # the continued sequence still decodes through the graph
            messages.append({"role": "assistant", "content": want})
        base = list(range(3, 83))
        assert _greedy(warm, base) == (_greedy(cold, base)[0], 0)
        assert _greedy(warm, base[:50] + [7, 7]) == (_greedy(cold, base[:50] + [7, 7])[0], 50)   # a fork
        # float16 greedy can flip at a near tie between kernels (batched, graph, a forked prefix's cascade): the
        # prompts whose cold answer is the same alone and in a batch must get it with the cache too
        prompts = [base[:40 + 3 * i] + [i] for i in range(8)]
        alone = [_greedy(cold, p)[0] for p in prompts]
        batched, cached = _concurrently(cold, prompts), _concurrently(warm, prompts)
        robust = [i for i in range(8) if alone[i] == batched[i]]
        assert len(robust) >= 6
        assert [cached[i] for i in robust] == [alone[i] for i in robust]
        assert [_greedy(warm, prompts[i])[0] for i in robust] == [alone[i] for i in robust]
        core = warm.core
        assert core.pages_in_use() == 0 and core.free_pages() + core.cached_pages() == core.total_pages
        core.prefix_cache.clear()
        assert core.free_pages() == core.total_pages

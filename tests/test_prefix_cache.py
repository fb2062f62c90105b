"""Automatic prefix caching (runtime.core.prefix_cache): greedy outputs equal a cold engine's (prefix cache off) for
shared prefixes that end inside a page and at a page boundary, for concurrent requests, after evictions and after
preemption, and no KV page leaks. The tiny test Llama's tokenizer is byte-level: prompts are token ids here."""

from __future__ import annotations

import asyncio
import queue
import random
import threading

import pytest

from mlcc import AsyncEngine, Engine
from mlcc.runtime.core.prefix_cache import PrefixCache
from mlcc.runtime.core.request import Request
from mlcc.runtime.core.sampler import SamplingParams

PS = 16


@pytest.fixture(scope="module")
def model_dir(compiled):
    return compiled("llama", "q0f32")


@pytest.fixture(scope="module")
def cold(model_dir):
    e = Engine(model_dir, target="llvm", max_batch=4, prefix_cache=False)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def warm(model_dir):
    e = Engine(model_dir, target="llvm", max_batch=4)
    yield e
    e.shutdown()


def ids(start: int, n: int) -> list[int]:
    return [(start + 7 * i) % 250 + 3 for i in range(n)]


def greedy(engine: Engine, prompt: list[int], new: int = 6, **kw) -> tuple[list[str], int]:
    r = engine.completions.create(prompt=prompt, max_tokens=new, temperature=0, **kw)
    return [c.text for c in r.choices], r.usage.prompt_tokens_details.cached_tokens


def settled(engine: Engine) -> None:
    """Nothing runs: every page is free or held by the cache alone, as the cache's mirror counts them."""
    core = engine.core
    assert core.pages_in_use() == 0
    assert core.free_pages() + core.cached_pages() == core.total_pages


def empty_cache(engine: Engine) -> None:
    engine.core.prefix_cache.clear()   # the engine is idle: its worker is not touching the cache
    assert engine.core.free_pages() == engine.core.total_pages


def test_shared_prefixes_inside_a_page_and_at_a_page_boundary(cold, warm):
    empty_cache(warm)
    base = ids(1, 48)                                   # three full pages
    cases = [(base + [9, 9], 0),                        # nothing cached yet
             (base[:40] + [5, 6, 7], 40),               # shares 2.5 pages: the third is copied
             (base[:32] + [8, 8, 8], 32),               # ends at a page boundary
             (base[:32], 31),                           # the whole prompt is cached: its last token is recomputed
             (base + [9, 9], 49),                       # the same prompt again
             (ids(100, 20), 0)]                         # another prefix
    for prompt, cached in cases:
        want, none = greedy(cold, prompt)
        got, hit = greedy(warm, prompt)
        assert (got, hit) == (want, cached), prompt
        assert none == 0
    settled(warm)


def test_chat_turns_reuse_the_previous_turn(cold, warm):
    empty_cache(warm)
    messages = [{"role": "system", "content": "You are a terse assistant. " * 3}]
    previous = 0
    for turn in range(4):
        messages.append({"role": "user", "content": f"question number {turn}?"})
        kw = dict(messages=messages, max_tokens=8, temperature=0)
        want = cold.chat.completions.create(**kw).choices[0].message.content
        r = warm.chat.completions.create(**kw)
        assert r.choices[0].message.content == want
        # at least the previous turn's prompt (its answer too, as far as its text re-encodes to the same tokens)
        assert r.usage.prompt_tokens_details.cached_tokens >= previous, turn
        previous = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": want})
    # each turn continued the previous turn's sequence (its prompt was all reused): one entry
    assert warm.core.prefix_cache.num_entries == 1
    settled(warm)


def test_interleaved_concurrent_requests(cold, warm):
    empty_cache(warm)
    systems = [ids(3, 37), ids(50, 64)]
    prompts = [systems[i % 2] + ids(200 + i, 3 + i) for i in range(10)]
    want = [greedy(cold, p, 8)[0] for p in prompts]
    for _round in range(2):
        got: dict[int, list[str]] = {}

        def run(i: int) -> None:
            got[i] = greedy(warm, prompts[i], 8)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[i] for i in range(len(prompts))] == want
    assert warm.core.prefix_cache.hits > 0
    settled(warm)


def test_n_choices_fork_a_cached_prefix(cold, warm):
    empty_cache(warm)
    prompt = ids(9, 40)
    greedy(warm, prompt[:35] + [1])
    want, _ = greedy(cold, prompt, 5, n=2)
    got, hit = greedy(warm, prompt, 5, n=2)
    assert got == want and hit == 35
    settled(warm)


def test_evictions_in_a_small_cache(cold, model_dir):
    """Nine pages, three a request: a hot prefix stays cached between cold ones, which push each other out (least
    recently used first); outputs stay those of a cold engine."""
    prompts = [ids(0, 30) + [i] if i % 2 else ids(10 * i, 30 + i % 3) for i in range(15)]
    want = [greedy(cold, p)[0] for p in prompts]
    with Engine(model_dir, target="llvm", max_batch=2, kv_cache_tokens=128) as small:
        assert small.core.total_pages < 10
        got = [greedy(small, p)[0] for p in prompts]
        cache = small.core.prefix_cache
        assert cache.evictions > 0 and cache.hits > 0
        settled(small)
        empty_cache(small)
    assert got == want


def submit_together(engine: Engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy ids of requests queued under the scheduler's lock, so the worker sees them all in its next step."""
    queues = [queue.Queue() for _ in prompts]
    reqs = [Request(list(p), SamplingParams(temperature=0, ignore_eos=True), new, q.put, None, set())
            for p, q in zip(prompts, queues)]
    with engine.core.scheduler._cv:  # reentrant: submit takes it again
        for r in reqs:
            engine.core.submit(r)
    out = []
    for q in queues:
        got = []
        while (ev := q.get(timeout=120)).kind == "delta":
            if ev.token_id is not None:
                got.append(ev.token_id)
        assert ev.kind == "finish", ev.error
        out.append(got)
    return out


def test_preempted_requests_resume_from_the_cache(cold, model_dir):
    """max_util with 5 pages for four growing requests: preempted ones leave their KV cached and are forked from
    it when re-admitted (or recomputed, if it was evicted meanwhile)."""
    prompts = [ids(20 * i, 10 + 5 * i) for i in range(4)]
    want = [submit_together(cold, [p], 30)[0] for p in prompts]
    with Engine(model_dir, target="llvm", max_batch=4, kv_cache_tokens=80, policy="max_util") as small:
        got = submit_together(small, prompts, 30)
        assert small.core.stats["preempted"] > 0
        settled(small)
    assert got == want


def test_pipelined_decode_leaves_exactly_its_tokens_cached(cold, model_dir):
    """A pipelined burst's last step is wasted (fed after the final token): the cached entry drops it."""
    prompt = ids(77, 33)
    want = greedy(cold, prompt, 20)[0]
    with Engine(model_dir, target="llvm", max_batch=2, pipeline=True) as e:
        assert greedy(e, prompt, 20)[0] == want
        assert e.core.stats["pipelined_tokens"] > 0
        assert greedy(e, prompt, 20) == (want, 32)
        settled(e)
        empty_cache(e)


def test_no_page_leaks_after_a_thousand_mixed_requests(model_dir):
    rng = random.Random(0)
    prefixes = [ids(k * 31, rng.randint(1, 40)) for k in range(6)]

    async def main(engine: AsyncEngine) -> int:   # between batches nothing runs: the mirror must match the KV cache
        async def one(i: int) -> int:
            prompt = (rng.choice(prefixes) + ids(i, rng.randint(0, 6)))[:48] or [5]
            r = await engine.completions.create(prompt=prompt, max_tokens=rng.randint(1, 2), n=rng.choice([1, 1, 2]),
                                                temperature=rng.choice([0, 1.0]), seed=i)
            return r.usage.prompt_tokens_details.cached_tokens
        cached = 0
        for batch in range(0, 1000, 100):
            cached += sum(await asyncio.gather(*(one(i) for i in range(batch, batch + 100))))
            settled(engine.engine)
        return cached

    with Engine(model_dir, target="llvm", max_batch=8, kv_cache_tokens=512) as e:
        total = e.core.total_pages
        assert asyncio.run(main(AsyncEngine(e))) > 0
        assert e.core.prefix_cache.evictions > 0
        settled(e)
        empty_cache(e)
        assert e.core.free_pages() == total


def test_prefix_cache_off(cold):
    assert cold.core.prefix_cache is None
    prompt = ids(5, 40)
    greedy(cold, prompt)
    assert greedy(cold, prompt)[1] == 0
    assert cold.core.free_pages() == cold.core.total_pages


def test_lookup_matches_whole_pages_then_tokens():
    """The index alone, over a fake KV cache: the longest cached prefix, at least a page, never the last token."""
    removed: list[int] = []
    cache = PrefixCache(4, removed.append, lambda: 0)
    a = list(range(10))                     # pages [0..3] [4..7], then 8, 9
    assert cache.insert(0, a, [])
    assert cache.match([0, 1, 2]) is None                   # under a page
    assert cache.match(a[:6] + [50]).pos == 6               # a page, then two tokens of the next
    assert cache.match(a).pos == 9                          # the last token is always computed
    assert cache.match(a + [11, 12]).pos == 10
    assert cache.match([9] + a) is None                     # a prefix starts at the first token
    assert cache.evictable_pages == 3                       # two full pages and a partly filled one
    assert not cache.insert(1, [1, 2], [])                  # shorter than a page: removed, not cached
    assert removed == [1]
    cache.clear()
    assert removed == [1, 0] and cache.evictable_pages == 0 and cache.match(a) is None


@pytest.mark.slow
def test_sliding_window_models_continue_sequences_only(compiled):
    """Gemma 2's alternating windows (8 tokens here): a chat's next turn continues the previous turn's sequence
    (exact), a fork (inexact over a window) is never made; answers equal a cold engine's."""
    d = compiled("gemma2", "q0f32")
    with Engine(d, target="llvm", prefix_cache=False) as cold, Engine(d, target="llvm") as warm:
        assert not warm.core.prefix_cache.forks
        messages = [{"role": "user", "content": "hello there, how are you today?"}]
        for turn in range(3):
            kw = dict(messages=messages, max_tokens=12, temperature=0)
            want = cold.chat.completions.create(**kw).choices[0].message.content
            r = warm.chat.completions.create(**kw)
            assert r.choices[0].message.content == want
            assert (r.usage.prompt_tokens_details.cached_tokens > 0) == (turn > 0)
            messages += [{"role": "assistant", "content": want}, {"role": "user", "content": f"and {turn}?"}]
        prompt = ids(5, 40)
        assert greedy(warm, prompt) == greedy(cold, prompt)
        assert greedy(warm, prompt[:30] + [1, 2]) == (greedy(cold, prompt[:30] + [1, 2])[0], 0)   # no fork
        settled(warm)

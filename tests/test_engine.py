"""Engine: OpenAI types, streaming, determinism, stop strings, templates, n > 1, penalties, echo, BOS, chunked
prefill, preemption, compile options, errors, integrity checks."""

import asyncio
import json
import queue
import shutil
import time

import numpy as np
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mlcc import AsyncEngine, CompileOptions, Engine
from mlcc.errors import ArtifactError, ContextWindowExceededError, RequestError
from mlcc.runtime.core.request import Request
from mlcc.runtime.core.sampler import SamplingParams

MSGS = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(compiled):
    e = Engine(compiled("llama", "q0f32"), target="llvm", max_batch=4)
    yield e
    e.shutdown()


def test_chat_returns_openai_types(engine):
    r = engine.chat.completions.create(messages=MSGS, max_tokens=8, temperature=0, ignore_eos=True)
    assert isinstance(r, ChatCompletion)
    ChatCompletion.model_validate(r.model_dump())  # round-trips through the openai schema
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == len(engine.encode_chat(MSGS))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_stream_concatenates_to_non_stream(engine):
    full = engine.chat.completions.create(messages=MSGS, max_tokens=20, temperature=0)
    chunks = list(engine.chat.completions.create(messages=MSGS, max_tokens=20, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_greedy_is_deterministic_and_seed_reproduces(engine):
    a = engine.chat.completions.create(messages=MSGS, max_tokens=16, temperature=0).choices[0].message.content
    b = engine.chat.completions.create(messages=MSGS, max_tokens=16, temperature=0).choices[0].message.content
    assert a == b
    kw = dict(messages=MSGS, max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    s1 = engine.chat.completions.create(**kw).choices[0].message.content
    s2 = engine.chat.completions.create(**kw).choices[0].message.content
    assert s1 == s2
    others = {engine.chat.completions.create(**{**kw, "seed": s}).choices[0].message.content for s in range(4)}
    assert len(others | {s1}) > 1  # sampling actually samples


def test_n_choices_read_the_prompt_once_and_equal_separately_seeded_requests(engine):
    """n > 1 forks the prefilled sequence: choice i is what a lone request seeded seed + i returns."""
    n_prompt = len(engine.encode_chat(MSGS))
    for kw in (dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, frequency_penalty=1.0)):  # device, host
        kw.update(messages=MSGS, max_tokens=12, ignore_eos=True)
        before = engine.core.stats["prefill_tokens"]
        r = engine.chat.completions.create(n=3, seed=7, **kw)
        cached = r.usage.prompt_tokens_details.cached_tokens   # the prefix cache served the rest
        assert engine.core.stats["prefill_tokens"] - before == n_prompt - cached
        assert [c.index for c in r.choices] == [0, 1, 2]
        alone = [engine.chat.completions.create(seed=7 + i, **kw).choices[0].message.content for i in range(3)]
        assert [c.message.content for c in r.choices] == alone
        assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 3 * 12
    streamed = ["", ""]
    for c in engine.chat.completions.create(messages=MSGS, max_tokens=10, temperature=0, n=2, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    greedy = engine.chat.completions.create(messages=MSGS, max_tokens=10, temperature=0).choices[0].message.content
    assert streamed == [greedy, greedy]
    _wait_for_free_pages(engine)


def test_stop_string_cuts_output(engine):
    base = engine.completions.create(prompt="abc", max_tokens=24, temperature=0).choices[0].text
    assert len(base) > 6
    stop = base[3:5]
    cut = base[: base.index(stop)]
    r = engine.completions.create(prompt="abc", max_tokens=24, temperature=0, stop=[stop])
    assert isinstance(r, Completion)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in engine.completions.create(
        prompt="abc", max_tokens=24, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == cut


def test_multi_turn_uses_the_template(engine):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    text = engine.tokenizer.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1"
                    "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n")
    ids = engine.encode_chat(msgs)
    assert engine.tokenizer.tok.token_to_id("<|im_start|>") in ids
    r = engine.chat.completions.create(messages=msgs, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=3.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"), (dict(presence_penalty=5), "presence_penalty"), (dict(top_k=-2), "top_k"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"), (dict(messages=[]), "messages"),
    (dict(frobnicate=1), "frobnicate"),
])
def test_bad_params_raise_clear_errors_and_engine_keeps_working(engine, kw, param):
    with pytest.raises(RequestError) as ei:
        engine.chat.completions.create(**{"messages": MSGS, "max_tokens": 4, **kw})
    assert ei.value.param.split("[")[0] == param   # messages[0].role: OpenAI's path to the field
    assert engine.chat.completions.create(messages=MSGS, max_tokens=2, temperature=0).choices


def test_context_window_overflow(engine):
    long = "x" * 600  # 600 byte tokens > 512 context
    with pytest.raises(ContextWindowExceededError, match="maximum context length is 512"):
        engine.chat.completions.create(messages=[{"role": "user", "content": long}], max_tokens=4)
    with pytest.raises(ContextWindowExceededError, match="Lower max_tokens"):
        engine.chat.completions.create(messages=MSGS, max_tokens=10_000)
    assert engine.chat.completions.create(messages=MSGS, max_tokens=2, temperature=0).choices


def test_penalised_greedy_decoding_follows_the_formula(engine, compiled):
    """Each step's argmax over the model's logits after HF's repetition penalty (prompt and output) and OpenAI's
    frequency/presence penalties (output), computed here by hand."""
    from mlcc.runtime.device.model import LoadedModel

    rep, freq, pres, steps = 1.8, 1.5, 0.5, 16
    prompt = engine.encode_prompt("aaaa")
    got, _ = _token_ids(engine, "aaaa", steps, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    m = LoadedModel(compiled("llama", "q0f32"))
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    logits, want = m.prefill([0], [prompt]).numpy()[0], []
    for _ in range(steps):
        z = logits.astype(np.float64)
        for t in set(prompt) | set(want):
            z[t] = z[t] / rep if z[t] > 0 else z[t] * rep
        for t in set(want):
            z[t] -= freq * want.count(t) + pres
        want.append(int(np.argmax(z)))
        logits = m.decode([0], [want[-1]]).numpy()[0]
    assert got == want
    assert _token_ids(engine, "aaaa", steps)[0] != want   # the penalties change this prompt's greedy tokens


def test_concurrent_requests_equal_sequential(engine):
    import concurrent.futures as cf

    prompts = ["one", "two two", "three three three", "four", "five five"]
    seq = [engine.completions.create(prompt=p, max_tokens=12, temperature=0).choices[0].text for p in prompts]
    with cf.ThreadPoolExecutor(5) as ex:
        par = list(ex.map(lambda p: engine.completions.create(prompt=p, max_tokens=12, temperature=0)
                          .choices[0].text, prompts))
    assert par == seq
    assert engine.core.pages_in_use() == 0


def test_async_engine(engine):
    ae = AsyncEngine(engine)

    async def main():
        r = await ae.chat.completions.create(messages=MSGS, max_tokens=10, temperature=0)
        s = await ae.chat.completions.create(messages=MSGS, max_tokens=10, temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in s if c.choices])
        many = await asyncio.gather(*[ae.completions.create(prompt=p, max_tokens=6, temperature=0)
                                      for p in ("a", "bb", "ccc")])
        return r, text, many

    r, text, many = asyncio.run(main())
    assert text == r.choices[0].message.content
    assert [m.choices[0].text for m in many] == [
        engine.completions.create(prompt=p, max_tokens=6, temperature=0).choices[0].text for p in ("a", "bb", "ccc")]


def test_abandoned_stream_frees_its_pages(engine):
    it = engine.chat.completions.create(messages=MSGS, max_tokens=200, temperature=0, stream=True)
    next(it), next(it)
    it.close()
    _wait_for_free_pages(engine)


def test_corrupted_shard_is_refused(compiled, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(compiled("llama", "q0f32"), d)
    shard = next(d.glob("params_shard_*.bin"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="corrupted \\(sha256 mismatch\\)"):
        Engine(d, target="llvm")


def test_library_from_another_quantization_is_refused(compiled, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(compiled("llama", "q0f32"), d)
    shutil.copy(compiled("llama", "q4f32_1") / "model.so", d / "model.so")
    with pytest.raises(ArtifactError, match="built for quantization='q4f32_1'.*recompile with `mlcc compile"):
        Engine(d, target="llvm")


def test_weights_from_another_model_are_refused(compiled, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(compiled("llama", "q0f32"), d)
    cfg = json.loads((d / "mlcc-config.json").read_text())
    cfg["stamp"]["param_hash"] = "0" * 16
    (d / "mlcc-config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="param_hash"):
        Engine(d, target="llvm")


def test_compiled_sampler_follows_the_distribution(compiled):
    """The library's own sample_top_p_top_k: frequencies match softmax(logits / T); top-k / top-p truncate."""
    import numpy as np

    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(compiled("llama", "q0f32"))
    f = m.fns.sample_top_p_top_k
    dev = m.to_device
    logits = np.full((1, m.vocab), -30.0, np.float32)
    logits[0, [3, 7, 11, 19]] = [0.0, 1.0, 2.0, 3.0]

    def draw(temp, top_p, top_k, u):
        return int(f(dev(logits), dev(np.array([temp], np.float32)), dev(np.array([top_p], np.float32)),
                     dev(np.array([top_k], np.int32)), dev(np.array([u], np.float32)),
                     dev(np.array([0], np.int32))).numpy()[0])

    us = np.random.default_rng(0).random(3000)
    for temp in (1.0, 0.5):
        z = logits[0, [3, 7, 11, 19]] / temp
        p = np.exp(z - z.max())
        p /= p.sum()
        counts = np.bincount([draw(temp, 1.0, m.vocab, u) for u in us], minlength=m.vocab)
        freq = counts[[3, 7, 11, 19]] / len(us)
        assert counts.sum() == counts[[3, 7, 11, 19]].sum()
        assert np.abs(freq - p).max() < 4 * np.sqrt(0.25 / len(us)), (freq, p)
    assert {draw(1.0, 1.0, 1, u) for u in us[:50]} == {19}                 # top_k=1 is argmax
    assert {draw(1.0, 1.0, 2, u) for u in us[:200]} == {11, 19}            # top_k=2
    assert {draw(1.0, 0.6, m.vocab, u) for u in us[:200]} == {19}          # top mass 0.64 ≥ 0.6


@pytest.fixture(scope="module")
def pipelined_engine(compiled):
    """The same model decoding a lone request pipelined (runtime.device.graph_decode.decode_pipelined), as on CUDA: ids
    drawn by the compiled argmax/sampler and left on the device, the loop on although reads cannot overlap here."""
    e = Engine(compiled("llama", "q0f32"), target="llvm", max_batch=4, pipeline=True)
    yield e
    e.shutdown()


def test_pipelined_decode_matches_the_synchronous_loop(engine, pipelined_engine):
    prompts = ["one", "two two", "three three three"]
    for p in prompts:
        want = engine.completions.create(prompt=p, max_tokens=24, temperature=0)
        before = pipelined_engine.core.stats["pipelined_tokens"]
        got = pipelined_engine.completions.create(prompt=p, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens
        assert pipelined_engine.core.stats["pipelined_tokens"] - before == got.usage.completion_tokens - 1
    # a stop token in the middle: the step queued behind it is dropped, its pages freed with the sequence
    toks, _ = _token_ids(engine, "one", 24)
    stop = toks[10]
    want = _token_ids(engine, "one", 24, stop_token_ids=[stop])
    assert _token_ids(pipelined_engine, "one", 24, stop_token_ids=[stop]) == want == (toks[:toks.index(stop)], "stop")
    _wait_for_free_pages(pipelined_engine)  # the finish event goes out before the worker removes the sequence


def test_pipelined_decode_queues_a_step_only_after_the_previous_steps_tail(engine, pipelined_engine, monkeypatch):
    """With a step tail (on CUDA: an event after the step's last KV-cache read, runtime.device.graph_decode), step k's
    KV-cache metadata must not be queued before step k-1 has passed it (TVM copies it into one buffer); the ids are
    still handed out in order and equal the synchronous loop's."""
    model, log = pipelined_engine.model, []
    queue = model.decode_fed_back

    class Tail:
        def __init__(self, step):
            self.step = step

        def synchronize(self):
            log.append(("passed", self.step))

    def decode_fed_back(seq_id, ids):
        step = sum(1 for e in log if e[0] == "queued")
        log.append(("queued", step))
        logits, _ = queue(seq_id, ids)
        return logits, Tail(step)

    monkeypatch.setattr(model, "decode_fed_back", decode_fed_back)
    want = engine.completions.create(prompt="two two", max_tokens=12, temperature=0)
    got = pipelined_engine.completions.create(prompt="two two", max_tokens=12, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    steps = sum(1 for e in log if e[0] == "queued")
    assert steps >= 10
    # every step after the first is queued right after its predecessor's tail was waited for, and only then
    assert log[:2 * steps - 1] == [e for k in range(steps) for e in ((("passed", k - 1),) if k else ()) + (("queued", k),)]
    _wait_for_free_pages(pipelined_engine)


def test_pipelined_sampling_draws_what_the_synchronous_path_draws(engine, pipelined_engine):
    """Seeded temperature/top-p sampling: the same uniform stream, drawn one a step, gives the same text."""
    for seed in (1, 7):
        kw = dict(prompt="two two", max_tokens=24, temperature=0.9, top_p=0.9, seed=seed)
        before = pipelined_engine.core.stats["pipelined_tokens"]
        got = pipelined_engine.completions.create(**kw)
        assert got.choices[0].text == engine.completions.create(**kw).choices[0].text
        assert pipelined_engine.core.stats["pipelined_tokens"] - before == got.usage.completion_tokens - 1
    # penalties need the history on the host: not pipelined, same answer
    kw = dict(prompt="aaaa", max_tokens=12, temperature=0, repetition_penalty=1.5)
    before = pipelined_engine.core.stats["pipelined_tokens"]
    assert pipelined_engine.completions.create(**kw).choices[0].text == engine.completions.create(**kw).choices[0].text
    assert pipelined_engine.core.stats["pipelined_tokens"] == before


def test_pipelined_decode_stops_for_an_abandoned_stream(pipelined_engine):
    before = pipelined_engine.core.stats["pipelined_tokens"]
    it = pipelined_engine.chat.completions.create(messages=MSGS, max_tokens=400, temperature=0, stream=True,
                                                  ignore_eos=True)
    next(it), next(it)
    it.close()
    _wait_for_free_pages(pipelined_engine)
    assert pipelined_engine.core.stats["pipelined_tokens"] - before < 399  # the burst stopped early
    assert pipelined_engine.chat.completions.create(messages=MSGS, max_tokens=4, temperature=0).choices


def test_pipelined_decode_yields_to_new_requests(engine, pipelined_engine):
    import concurrent.futures as cf

    prompts = ["one", "two two", "three three three", "four"]
    seq = [engine.completions.create(prompt=p, max_tokens=40, temperature=0).choices[0].text for p in prompts]
    with cf.ThreadPoolExecutor(4) as ex:
        futs = []
        for p in prompts:  # staggered: each arrives while the earlier ones decode
            futs.append(ex.submit(lambda p=p: pipelined_engine.completions.create(prompt=p, max_tokens=40,
                                                                                  temperature=0).choices[0].text))
            time.sleep(0.05)
        assert [f.result() for f in futs] == seq
    _wait_for_free_pages(pipelined_engine)


def test_completions_echo_the_prompt(engine):
    kw = dict(max_tokens=6, temperature=0)
    plain = engine.completions.create(prompt="abc", **kw)
    echoed = engine.completions.create(prompt="abc", echo=True, **kw)
    assert echoed.choices[0].text == "abc" + plain.choices[0].text and echoed.usage == plain.usage
    streamed = "".join(c.choices[0].text for c in engine.completions.create(prompt="abc", echo=True, stream=True, **kw)
                       if c.choices)
    assert streamed == echoed.choices[0].text
    ids = engine.encode_prompt("abc")
    assert engine.completions.create(prompt=ids, echo=True, **kw).choices[0].text == echoed.choices[0].text


def test_completions_start_with_bos_where_the_tokenizer_wants_it(compiled, tmp_path):
    """add_bos_token (as compiler/tokenizer_files.py records it): a completions prompt gets the BOS token once;
    a chat template that writes it is not doubled; token-id prompts are used as given."""
    from conftest import write_tokenizer

    from mlcc.compiler.tokenizer_files import tokenizer_info

    d = tmp_path / "m"
    shutil.copytree(compiled("llama", "q0f32"), d)
    write_tokenizer(d, bos_token="<s>")
    cfg = json.loads((d / "mlcc-config.json").read_text())
    cfg["tokenizer"] = tokenizer_info(d)
    assert cfg["tokenizer"]["add_bos_token"] is True and cfg["tokenizer"]["bos_token"] == "<s>"
    (d / "mlcc-config.json").write_text(json.dumps(cfg))
    with Engine(d, target="llvm", max_batch=2) as e:
        bos = e.tokenizer.tok.token_to_id("<s>")
        ids = e.encode_prompt("abc")
        assert ids == [bos, *e.tokenizer.encode("abc")] and e.encode_prompt("<s>abc") == ids
        r = e.completions.create(prompt="abc", max_tokens=8, temperature=0, echo=True)
        assert r.usage.prompt_tokens == 4 and r.choices[0].text.startswith("abc")
        by_ids = e.completions.create(prompt=ids, max_tokens=8, temperature=0)
        assert r.choices[0].text == "abc" + by_ids.choices[0].text and by_ids.usage.prompt_tokens == 4
        chat = e.encode_chat(MSGS)
        assert chat[0] == bos and chat.count(bos) == 1
        assert e.completions.create(prompt=ids[1:], max_tokens=2).usage.prompt_tokens == 3


def test_prompts_longer_than_the_prefill_chunk_give_the_same_greedy_tokens(engine, compiled):
    prompts = ["the quick brown fox jumps over the lazy dog " * 3, "short", "a longer prompt that is cut " * 2]
    want = _all_token_ids(engine, prompts, 16)
    with Engine(compiled("llama", "q0f32"), target="llvm", max_batch=4, prefill_chunk=24) as chunked:
        got = _all_token_ids(chunked, prompts, 16)
        total = sum(len(chunked.encode_prompt(p)) for p in prompts)
        assert chunked.core.stats["prefill_tokens"] == total
        assert chunked.core.stats["prefill_steps"] >= -(-total // 24) > len(prompts)
    assert got == want


def test_max_util_preempts_and_recomputes_to_the_same_greedy_tokens(engine, compiled):
    """A KV cache of 6 pages for four requests of up to 4 pages each: max_util preempts the most recent ones and
    recomputes them later; every request still gets the tokens it gets alone."""
    prompts = ["one", "two two", "three three three", "four four four four"]
    want = [_token_ids(engine, p, 40)[0] for p in prompts]
    with Engine(compiled("llama", "q0f32"), target="llvm", max_batch=4, kv_cache_tokens=80,
                policy="max_util") as small:
        assert small.core.total_pages < 4 * 4
        got = _all_token_ids(small, prompts, 40)
        assert small.core.stats["preempted"] > 0
        _wait_for_free_pages(small)
    assert got == want


def test_a_folder_built_with_other_compile_options_is_refused(compiled):
    d = compiled("llama", "q0f32")
    with pytest.raises(ArtifactError, match=r"asked for compile options pdl=False \(built with True\).*"
                                            r"--option pdl=0 --output"):
        Engine(d, target="llvm", options=CompileOptions(pdl=False))
    with Engine(d, target="llvm", max_batch=1, options=CompileOptions()) as e:   # what it was built with
        assert e.completions.create(prompt="abc", max_tokens=2).choices


def test_jit_builds_are_keyed_by_their_compile_options(hf_models, tmp_path, monkeypatch):
    from mlcc.compiler import build
    from mlcc.runtime.jit import build_dir, resolve_model

    monkeypatch.setenv("MLCC_CACHE_DIR", str(tmp_path))
    src = hf_models("llama")
    default = build_dir(src, "llvm", "q0f32", 1, CompileOptions())
    assert build_dir(src, "llvm", "q0f32", 1, CompileOptions()) == default
    assert build_dir(src, "llvm", "q0f32", 1, CompileOptions(decode_graph=False)) != default
    assert build_dir(src, "llvm", "q0f32", 1, CompileOptions(decode_attention_splits=4)) != default
    calls = []

    def fake_compile(model, target, quant, out, tensor_parallel=1, options=None):
        calls.append(options)
        out.mkdir(parents=True)
        (out / "mlcc-config.json").write_text("{}")

    monkeypatch.setattr(build, "compile_model", fake_compile)
    opts = CompileOptions(pdl=False)
    out = resolve_model(src, "llvm", "q0f32", options=opts)
    assert out == build_dir(src, "llvm", "q0f32", 1, opts) != default and calls == [opts]
    assert resolve_model(src, "llvm", "q0f32", options=opts) == out and len(calls) == 1   # cached
    assert resolve_model(src, "llvm", "q0f32") == default and calls[1] == CompileOptions()


def _all_token_ids(engine, prompts: list[str], n: int, **params) -> list[list[int]]:
    """Greedy ids of several requests submitted together (so that they run side by side)."""
    queues = [queue.Queue() for _ in prompts]
    reqs = [Request(engine.encode_prompt(p), SamplingParams(temperature=0, ignore_eos=True, **params), n, q.put,
                    None, set()) for p, q in zip(prompts, queues)]
    for r in reqs:
        engine.core.submit(r)
    out = []
    for q in queues:
        ids = []
        while (ev := q.get(timeout=120)).kind == "delta":
            if ev.token_id is not None:
                ids.append(ev.token_id)
        assert ev.kind == "finish", ev.error
        out.append(ids)
    return out


def test_a_request_waiting_for_pages_does_not_stall_a_pipelined_one(engine, compiled):
    """no_evict with room for one request at a time: the second waits while the first decodes (step by step once
    it waits), then runs; both get their greedy tokens."""
    prompts = ["one", "two two"]
    want = [_token_ids(engine, p, 60)[0] for p in prompts]
    with Engine(compiled("llama", "q0f32"), target="llvm", max_batch=4, kv_cache_tokens=80, pipeline=True) as e:
        assert e.core.total_pages < 2 * 5
        assert _all_token_ids(e, prompts, 60) == want
        assert e.core.stats["pipelined_tokens"] > 0


def _wait_for_free_pages(engine) -> None:
    for _ in range(100):
        if engine.core.pages_in_use() == 0:
            return
        time.sleep(0.05)
    assert engine.core.pages_in_use() == 0


def _token_ids(engine, prompt: str, n: int, **params) -> tuple[list[int], str]:
    """The greedy ids themselves, straight from the engine core, and the finish reason."""
    q: queue.Queue = queue.Queue()
    req = Request(engine.encode_prompt(prompt), SamplingParams(temperature=0, ignore_eos=True, **params), n, q.put,
                  None, set())
    engine.core.submit(req)
    out = []
    while True:
        ev = q.get(timeout=60)
        if ev.kind == "delta" and ev.token_id is not None:
            out.append(ev.token_id)
        if ev.kind != "delta":
            return out, ev.finish_reason


def test_images_to_a_text_only_model_are_refused_naming_the_part(engine):
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    with pytest.raises(RequestError) as e:
        engine.chat.completions.create(messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert e.value.param == "messages[0].content[1].image_url" and "takes no images" in str(e.value)

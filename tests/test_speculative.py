"""Speculative decoding (runtime.spec.speculative): greedy output equals plain decoding (n-gram and draft models, random
tiny models and the bundled SmolLM2), the rejection sampler keeps the target distribution, the KV cache holds
exactly a request's tokens after rejections, speculating and plain requests share a batch, bad configs are refused,
and `mlcc serve --speculative-config` reports acceptance in /metrics."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import openai
import pytest
from conftest import write_tokenizer
from server_support import mlcc_serve

from mlcc import Engine
from mlcc.errors import SpeculativeConfigError
from mlcc.runtime.core.sampler import SamplingParams, target_probs
from mlcc.runtime.spec.draft import check_same_tokenizer
from mlcc.runtime.spec.ngram import propose_ngram
from mlcc.runtime.spec.rejection import accept, accept_greedy
from mlcc.runtime.spec.spec_config import parse_speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# a repeated phrase: the tiny random models (one token per byte) soon loop, which n-gram lookup predicts
PROMPT = [(7 * i) % 50 + 60 for i in range(12)] * 3


@pytest.fixture(autouse=True)
def _always_speculate(monkeypatch):
    """These tests are about what speculation computes, so it runs even where the start-up cost probe would keep
    it off (a draft as large as the target, a loaded CI machine); tests/test_speculative_cost.py tests the probe."""
    import mlcc.runtime.spec.speculative as speculative

    monkeypatch.setattr(speculative, "speculative_step_cost", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def target(compiled):
    return compiled("llama", "q0f32")


@pytest.fixture(scope="module")
def plain(target):
    with Engine(target, target="llvm", max_batch=4, prefix_cache=False) as e:
        yield e


def _greedy(engine: Engine, prompt, n: int = 40, **kw) -> list[str]:
    r = engine.completions.create(prompt=prompt, max_tokens=n, temperature=0, **kw)
    return [c.text for c in r.choices]


def _settled(engine: Engine) -> None:
    core = engine.core
    assert core.pages_in_use() == 0
    assert core.free_pages() + core.cached_pages() == core.total_pages


# -- configuration ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config,match", [
    ({"method": "ngram", "num_speculative_tokens": 5, "lookahead": 2}, "unknown key 'lookahead'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "num_speculative_tokens: Field required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "larger than"),
    ({"method": "draft", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "takes no 'model'"),
    ("{not json", "not valid JSON"),
    ([1], "must be an object"),
])
def test_bad_configs_are_refused_with_the_key(target, config, match):
    with pytest.raises(SpeculativeConfigError, match=match):
        Engine(target, target="llvm", speculative_config=config)


def test_vllm_defaults_for_the_lookup_window():
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert parse_speculative_config({"model": "m", "num_speculative_tokens": 2}).method == "draft"
    assert parse_speculative_config({"method": "draft_model", "model": "m", "num_speculative_tokens": 2}).method \
        == "draft"


def test_draft_with_another_tokenizer_is_refused(tmp_path, target):
    other = tmp_path / "other"
    other.mkdir()
    write_tokenizer(other, bos_token="<s>")   # one special token more
    with pytest.raises(SpeculativeConfigError, match="another tokenizer"):
        check_same_tokenizer(target, other)
    check_same_tokenizer(target, target)
    with pytest.raises(SpeculativeConfigError, match="no such model"):
        Engine(target, target="llvm", speculative_config={"model": str(tmp_path / "none"),
                                                          "num_speculative_tokens": 2})


def test_ngram_lookup():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3) == [4, 5, 1]
    assert propose_ngram([1, 2, 3, 9, 2, 3], 2, 2, 2) == [9, 2]
    assert propose_ngram([1, 2, 3], 3, 2, 3) == []
    assert propose_ngram([4, 1, 2, 5, 1, 2], 2, 1, 4) == [5, 1]   # the most recent occurrence


# -- greedy identity -------------------------------------------------------------------------------------------

def test_ngram_greedy_equals_plain_decoding(plain, target):
    prompts = [PROMPT, PROMPT[5:30], [3, 4, 5, 6] * 6]
    want = [_greedy(plain, p) for p in prompts]
    with Engine(target, target="llvm", max_batch=4, speculative_config=NGRAM) as spec:
        assert [_greedy(spec, p) for p in prompts] == want
        st = spec.core.stats
        assert st["spec_accepted_tokens"] > 0 and st["spec_accepted_tokens"] < st["spec_draft_tokens"]
        assert spec.core.speculator.mean_tokens_per_step() > 1
        _settled(spec)


@pytest.mark.parametrize("draft_kind", ["llama", "qwen2"])   # itself (all accepted), another model (most rejected)
def test_draft_model_greedy_equals_plain_decoding(plain, target, compiled, draft_kind):
    prompts = [PROMPT, [9, 8, 7, 100, 101, 102, 5]]
    want = [_greedy(plain, p, 30) for p in prompts]
    config = {"method": "draft", "model": str(compiled(draft_kind, "q0f32")), "num_speculative_tokens": 4}
    with Engine(target, target="llvm", max_batch=4, speculative_config=config) as spec:
        assert [_greedy(spec, p, 30) for p in prompts] == want
        rate = spec.core.speculator.acceptance_rate()
        assert rate == 1.0 if draft_kind == "llama" else rate < 1.0
        _settled(spec)
        assert spec.core.speculator.draft.model.free_pages() == spec.core.speculator.draft.total_pages


def test_device_argmax_paths_equal_plain_decoding(plain, target, compiled):
    """The paths a GPU takes for greedy requests (verification from the compiled argmax, the draft's ids fed back
    on the device), forced on the CPU: the same answers."""
    prompts = [PROMPT, [9, 8, 7, 100, 101, 102, 5]]
    want = [_greedy(plain, p, 30) for p in prompts]
    for kind in ("llama", "qwen2"):
        config = {"method": "draft", "model": str(compiled(kind, "q0f32")), "num_speculative_tokens": 4}
        with Engine(target, target="llvm", max_batch=4, speculative_config=config) as spec:
            speculator = spec.core.speculator
            speculator.device_argmax = speculator.draft.chain_on_device = True
            assert [_greedy(spec, p, 30) for p in prompts] == want
            assert spec.core.stats["spec_drafts"] > 0
            _settled(spec)
            assert speculator.draft.model.free_pages() == speculator.draft.total_pages


def test_a_paused_lone_request_resumes_speculating(plain, target, compiled):
    """A draft that is mostly wrong pauses a lone request's speculation; the cool-down is counted in steps, so
    the request is not handed to the pipelined burst (which would decode it plainly to its end) and speculates
    again afterwards, with the same answer."""
    from mlcc.runtime.spec.speculative import COOLDOWN, WINDOW

    config = {"method": "draft", "model": str(compiled("qwen2", "q0f32")), "num_speculative_tokens": 4}
    n = 2 * WINDOW + COOLDOWN[0] + 16
    want = _greedy(plain, PROMPT, n)
    with Engine(target, target="llvm", max_batch=2, speculative_config=config, pipeline=True) as spec:
        assert _greedy(spec, PROMPT, n) == want
        st = spec.core.stats
        assert st["spec_pauses"] >= 1 and st["spec_drafts"] > WINDOW, dict(st)
        _settled(spec)


def test_stop_strings_max_tokens_and_streaming(plain, target):
    base = _greedy(plain, PROMPT, 40)[0]
    stop = base[17:19]
    with Engine(target, target="llvm", max_batch=2, speculative_config=NGRAM) as spec:
        for kw in (dict(stop=[stop]), dict(max_tokens=7), dict(max_tokens=1)):
            kw = {"max_tokens": 40, **kw}
            r = spec.completions.create(prompt=PROMPT, temperature=0, **kw)
            w = plain.completions.create(prompt=PROMPT, temperature=0, **kw)
            assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == \
                (w.choices[0].text, w.choices[0].finish_reason, w.usage.completion_tokens)
            streamed = "".join(c.choices[0].text for c in spec.completions.create(
                prompt=PROMPT, temperature=0, stream=True, **kw) if c.choices)
            assert streamed == w.choices[0].text
        _settled(spec)


def test_mixed_batch_with_and_without_speculation(plain, target):
    """Concurrent requests: speculating ones, one with logit_bias and one with logprobs (these decode plainly), and
    a sampled one; every greedy answer equals a plain engine's."""
    prompts = [PROMPT, PROMPT[3:], [3, 4, 5, 6] * 6, PROMPT[10:]]
    extra = [{}, {"logit_bias": {"70": -100.0}}, {"logprobs": 2}, {}]
    want = [_greedy(plain, p, 30, **x) for p, x in zip(prompts, extra)]
    with Engine(target, target="llvm", max_batch=4, speculative_config=NGRAM) as spec:
        got: dict[int, list[str]] = {}

        def run(i: int) -> None:
            got[i] = _greedy(spec, prompts[i], 30, **extra[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        threads.append(threading.Thread(target=lambda: spec.completions.create(
            prompt=PROMPT, max_tokens=30, temperature=0.9, seed=3)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[i] for i in range(4)] == want
        assert spec.core.stats["spec_drafts"] > 0
        _settled(spec)


# -- KV consistency --------------------------------------------------------------------------------------------

def test_kv_holds_exactly_the_tokens_after_rejections(target, compiled):
    """A draft that is mostly wrong: after the request ends, its cached sequence holds exactly its tokens, and the
    next decode step's logits on it equal a cold recompute of the same tokens."""
    from mlcc.runtime.device.model import LoadedModel

    config = {"method": "draft", "model": str(compiled("qwen2", "q0f32")), "num_speculative_tokens": 4}
    with Engine(target, target="llvm", max_batch=2, speculative_config=config) as spec:
        r = spec.completions.create(prompt=PROMPT, max_tokens=25, temperature=0)
        assert r.choices[0].finish_reason == "length"
        st = spec.core.stats
        assert st["spec_draft_tokens"] > st["spec_accepted_tokens"]   # there were rejections
        cache, model = spec.core.prefix_cache, spec.core.model
        (entry,) = list(cache._entries)
        assert model.seq_lens[entry.seq_id] == len(entry.tokens) == len(PROMPT) + 24
        nxt = 11
        warm = model.decode([entry.seq_id], [nxt]).numpy()[0]
        model.popn(entry.seq_id, 1)
    cold = LoadedModel(target)
    cold.create_kv_cache(1, 256, 128)
    cold.add_sequence(0)
    want = cold.prefill([0], [entry.tokens + [nxt]]).numpy()[0]
    np.testing.assert_allclose(warm, want, rtol=1e-4, atol=1e-4)


# -- the distribution ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=12),
                                    SamplingParams(temperature=1.2, top_p=0.9)], ids=["t1", "topk", "topp"])
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_rejection_sampling_keeps_the_target_distribution(target, params, kind):
    """The first token speculative sampling emits is distributed as the target's own next token, whatever the
    proposal: here a point mass on a likely token (n-gram) or a second, different distribution (a draft), over the
    tiny model's logits (scaled by 8: peaked, like a trained model's). 20,000 draws with a fixed seed; the TV
    distance between the draws' frequencies and the exact distribution stays under 1.5 times its expected value for
    exact sampling (0.5 * sum_i sqrt(2 p_i (1 - p_i) / (pi n))), and so does the second token's given the first
    was the accepted proposal."""
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(target)
    m.create_kv_cache(1, 128, 64)
    m.add_sequence(0)
    m.prefill([0], [PROMPT[:-1]])
    logits = m.verify([0], [[PROMPT[-1], 70, 71]]).numpy() * 8
    p0 = target_probs(logits[0], params, (PROMPT, []))
    d0 = int(np.argsort(-p0)[1])   # the second most likely token: rejected often, accepted often
    if kind == "ngram":
        drafts, q = [d0, 71], None
    else:
        q = np.stack([target_probs(logits[0] * 0.5 + 0.3 * np.sin(np.arange(logits.shape[1])), params, (PROMPT, [])),
                      target_probs(logits[1], SamplingParams(temperature=2.0), (PROMPT, [d0]))])
        drafts = None
    rng = np.random.default_rng(1234)
    n, first, second = 20_000, np.zeros(p0.size), np.zeros(p0.size)
    for _ in range(n):
        ds = drafts
        if ds is None:   # the draft draws its own proposals from q
            ds = [int(rng.choice(q.shape[1], p=q[0])), int(rng.choice(q.shape[1], p=q[1]))]
        out, kept = accept(logits, ds, q, params, PROMPT, [], rng)
        first[out[0]] += 1
        if out[0] == d0 and kind == "ngram":
            second[out[1]] += 1
    assert _tv(first, p0) < 1.5 * _expected_tv(p0, n)
    if kind == "ngram":
        p1 = target_probs(logits[1], params, (PROMPT, [d0]))
        assert second.sum() > 500
        assert _tv(second, p1) < 1.5 * _expected_tv(p1, second.sum())


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def _expected_tv(p: np.ndarray, n: float) -> float:
    """E[TV] of n exact draws from p (each frequency's deviation is about normal, E|N(0, s)| = s sqrt(2 / pi))."""
    return 0.5 * float(np.sqrt(2 * p * (1 - p) / (np.pi * n)).sum())


def test_greedy_acceptance_is_the_argmax():
    logits = np.zeros((3, 8), np.float32)
    logits[0, 2] = logits[1, 5] = logits[2, 1] = 1.0
    p = SamplingParams(temperature=0)
    rng = np.random.default_rng(0)
    assert accept(logits, [2, 5], None, p, [], [], rng) == ([2, 5, 1], 2)
    assert accept(logits, [2, 4], None, p, [], [], rng) == ([2, 5], 1)
    assert accept(logits, [3, 5], None, p, [], [], rng) == ([2], 0)
    best = logits.argmax(-1)
    for drafts in ([2, 5], [2, 4], [3, 5], []):
        assert accept_greedy(best, drafts) == accept(logits[:len(drafts) + 1], drafts, None, p, [], [], rng)


# -- real weights ----------------------------------------------------------------------------------------------

def test_smollm2_ngram_greedy_equals_plain_on_a_copy_heavy_prompt():
    """The bundled SmolLM2 (real weights, its cached CPU build) asked to repeat code: n-gram proposals are mostly
    accepted, and the answer is plain greedy decoding's, token for token."""
    code = "".join(f"def f{i}(x):\n    return x * {i} + {i + 1}\n\n" for i in range(6))
    msgs = [{"role": "user", "content": f"Copy this code exactly:\n\n{code}"}]
    kw = dict(messages=msgs, max_tokens=96, temperature=0)
    with Engine(target="llvm", max_batch=1) as e:
        want = e.chat.completions.create(**kw).choices[0].message.content
    with Engine(target="llvm", max_batch=1, speculative_config=NGRAM) as e:
        assert e.chat.completions.create(**kw).choices[0].message.content == want
        assert e.core.speculator.mean_tokens_per_step() > 2


@pytest.fixture(scope="module")
def smollm2_pair():
    """The bundled SmolLM2 without and with n-gram speculation (max_batch 2: a grammar request and a speculating
    one decode together)."""
    with Engine(target="llvm", max_batch=2) as plain, \
            Engine(target="llvm", max_batch=2, speculative_config=NGRAM) as spec:
        yield plain, spec


QUOTE = ("Quote the following notice word for word, then stop:\n\nThe library is open from nine in the morning until "
         "six in the evening on weekdays, and from ten until four on Saturdays. Books may be borrowed for three "
         "weeks and renewed twice, online or at the front desk, unless another reader has reserved them. Late "
         "returns cost twenty cents a day per book. Study rooms on the second floor can be booked for up to two "
         "hours at a time.")
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 30}},
    "required": ["name", "age", "city"], "additionalProperties": False}}}


def _chat(engine: Engine, text: str, **kw):
    return engine.chat.completions.create(messages=[{"role": "user", "content": text}], temperature=0, **kw)


def test_json_schema_with_speculation_equals_plain(smollm2_pair):
    """A response_format=json_schema request on a speculating engine: the same JSON as without speculation (the
    grammar's mask needs each token before the next: such requests decode plainly), alone and while another
    request speculates beside it."""
    plain, spec = smollm2_pair
    ask = "Give me a person who lives in Paris as JSON, with a name, an age and a city."
    want = _chat(plain, ask, response_format=PERSON, max_tokens=60)
    assert want.choices[0].finish_reason == "stop"
    value = json.loads(want.choices[0].message.content)
    assert set(value) == {"name", "age", "city"}
    drafts = spec.core.stats["spec_drafts"]
    got = _chat(spec, ask, response_format=PERSON, max_tokens=60)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == "stop"
    assert spec.core.stats["spec_drafts"] == drafts    # it did not speculate
    want_quote = _chat(plain, QUOTE, max_tokens=80).choices[0].message.content
    got: dict = {}
    threads = [threading.Thread(target=lambda: got.setdefault("json", _chat(spec, ask, response_format=PERSON,
                                                                             max_tokens=60))),
               threading.Thread(target=lambda: got.setdefault("quote", _chat(spec, QUOTE, max_tokens=80)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["json"].choices[0].message.content == want.choices[0].message.content
    assert got["quote"].choices[0].message.content == want_quote
    assert spec.core.stats["spec_drafts"] > drafts
    _settled(spec)


def test_stop_strings_inside_accepted_drafts(smollm2_pair):
    """SmolLM2 quoting a notice: most n-gram proposals are accepted (3-4 tokens per verify), so a stop string mostly
    ends inside a run of tokens one verify step emits: the text, finish reason and token count are plain
    decoding's, streamed too."""
    plain, spec = smollm2_pair
    full = _chat(plain, QUOTE, max_tokens=100).choices[0].message.content
    before = dict(spec.core.stats)
    for stop in ("three weeks", "front desk", "second floor", "reserved"):
        assert stop in full
        kw = dict(max_tokens=100, stop=[stop])
        w, r = _chat(plain, QUOTE, **kw), _chat(spec, QUOTE, **kw)
        assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == \
            (w.choices[0].message.content, "stop", w.usage.completion_tokens)
        assert r.choices[0].message.content == full[:full.index(stop)]
        streamed = "".join(c.choices[0].delta.content or "" for c in _chat(spec, QUOTE, stream=True, **kw)
                           if c.choices)
        assert streamed == w.choices[0].message.content
    st = spec.core.stats
    emitted, drafts = (st[k] - before.get(k, 0) for k in ("spec_emitted_tokens", "spec_drafts"))
    assert emitted > 2 * drafts > 0
    _settled(spec)


# -- the server ------------------------------------------------------------------------------------------------

def test_serve_flag_and_metrics(target, tmp_path):
    config = json.dumps(NGRAM)
    with mlcc_serve(target, tmp_path / "server.log", "--speculative-config", config) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=30,
                                      temperature=0)
        assert r.usage.completion_tokens > 0
        text = httpx.get(f"{base}/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("mlcc_spec_decode")}
        assert values["mlcc_spec_decode_num_drafts"] > 0
        assert 0 < values["mlcc_spec_decode_acceptance_rate"] <= 1
        assert values["mlcc_spec_decode_mean_tokens_per_step"] > 1


def test_serve_refuses_a_bad_config(target):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mlcc", "serve", str(target), "--target", "llvm",
                        "--speculative-config", '{"method": "ngram", "k": 3}'], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "unknown key 'k'" in r.stderr, r.stderr[-2000:]

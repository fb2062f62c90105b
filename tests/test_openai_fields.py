"""The OpenAI fields beyond plain sampling, through the Engine on the tiny compiled model: logprobs (chat and
completions, echo scoring), logit_bias, structured output (response_format, structured_outputs), tool calls, and
the refusals of what is not supported."""

import json
import re

import jsonschema
import numpy as np
import pytest
from openai.types.chat import ChatCompletion

from mlcc import Engine
from mlcc.errors import RequestError
from mlcc.runtime.device.model import LoadedModel

MSGS = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(compiled):
    e = Engine(compiled("llama", "q0f32"), target="llvm", max_batch=4)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def long_engine(compiled):
    """A context of 2,048 tokens: tool descriptions are long in a one-token-per-byte vocabulary."""
    e = Engine(compiled("llama_2k", "q0f32"), target="llvm", max_batch=2)
    yield e
    e.shutdown()


class _Reference:
    """The same library driven directly: the logits a request's tokens were drawn from."""

    def __init__(self, folder):
        self.m = LoadedModel(folder)
        self.m.create_kv_cache(1, 512, 128)

    def forced(self, prompt: list[int], tokens: list[int]) -> np.ndarray:
        """[1 + len(tokens), vocab]: after the prompt, then after each of tokens fed in."""
        m = self.m
        m.add_sequence(0)
        try:
            rows = [m.prefill([0], [prompt]).numpy()[0]]
            rows += [m.decode([0], [t]).numpy()[0] for t in tokens]
        finally:
            m.remove_sequence(0)
        return np.stack(rows).astype(np.float64)

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
        ids: list[int] = []
        for _ in range(n):   # n is small: recomputing from the start keeps this simple
            ids.append(int(self.forced(prompt, ids)[-1].argmax()))
        return ids, self.forced(prompt, ids[:-1])


@pytest.fixture(scope="module")
def reference(compiled):
    return _Reference(compiled("llama", "q0f32"))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_chat_logprobs_match_a_numpy_log_softmax_of_the_models_logits(engine, reference):
    r = engine.chat.completions.create(messages=MSGS, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 5 for t in content)
    prompt = engine.encode_chat(MSGS)
    ids, rows = reference.greedy(prompt, 6)
    ref = _log_softmax(rows)
    decode_bytes = engine.grammars.tokenizer.decode_bytes
    for j, t in enumerate(content):
        assert bytes(t.bytes) == decode_bytes([ids[j]])   # the greedy token, as its bytes
        assert t.logprob == pytest.approx(ref[j, ids[j]], abs=1e-4)
        top_ref = np.sort(ref[j])[::-1][:5]
        np.testing.assert_allclose([a.logprob for a in t.top_logprobs], top_ref, atol=1e-4)
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)   # greedy: the top one


def test_logprobs_false_gives_none_and_top_logprobs_without_logprobs_is_refused(engine):
    r = engine.chat.completions.create(messages=MSGS, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None
    with pytest.raises(RequestError) as e:
        engine.chat.completions.create(messages=MSGS, max_tokens=2, top_logprobs=3)
    assert e.value.param == "top_logprobs"


def test_streamed_chat_logprobs_equal_the_whole_answers(engine):
    kw = dict(messages=MSGS, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    whole = engine.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [t for c in engine.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in whole]


def test_completions_echo_scores_the_prompt_with_max_tokens_zero(engine, reference):
    text = "The quick brown fox"
    r = engine.completions.create(prompt=text, max_tokens=0, echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.text == text and r.usage.completion_tokens == 0
    lp = choice.logprobs
    ids = engine.encode_prompt(text)
    assert "".join(lp.tokens) == text and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(ids))]
    ref = _log_softmax(reference.forced(ids[:1], ids[1:-1]))   # row j predicts ids[j + 1] (teacher forcing)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]], abs=1e-4)
        assert len(lp.top_logprobs[j]) <= 3
        assert max(lp.top_logprobs[j].values()) == pytest.approx(ref[j - 1].max(), abs=1e-4)


def test_completions_logprobs_of_generated_tokens(engine):
    r = engine.completions.create(prompt="abc", max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)


def test_logit_bias_forces_and_bans_a_token(engine):
    forced = engine.tokenizer.encode("Z")[0]
    r = engine.chat.completions.create(messages=MSGS, max_tokens=5, temperature=0, ignore_eos=True,
                                       logit_bias={str(forced): 100})
    assert r.choices[0].message.content == "Z" * 5
    free = engine.chat.completions.create(messages=MSGS, max_tokens=3, temperature=0, ignore_eos=True)
    first = engine.tokenizer.encode(free.choices[0].message.content)[0]
    banned = engine.chat.completions.create(messages=MSGS, max_tokens=3, temperature=0, ignore_eos=True,
                                            logit_bias={str(first): -100})
    assert engine.tokenizer.encode(banned.choices[0].message.content)[0] != first


def test_logit_bias_keeps_seeded_sampling_deterministic(engine):
    kw = dict(messages=MSGS, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logit_bias={"65": 5, "66": -3})
    a = engine.chat.completions.create(**kw).choices[0].message.content
    b = engine.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(RequestError) as e:
        engine.chat.completions.create(messages=MSGS, max_tokens=2, logit_bias={"999999": 1})
    assert e.value.param == "logit_bias"


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_output_validates_even_from_a_random_model(engine, seed):
    r = engine.chat.completions.create(
        messages=MSGS, max_tokens=400, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_structured_outputs_regex_and_choice(engine):
    r = engine.completions.create(prompt="x", max_tokens=20, temperature=1.0, seed=1,
                                  structured_outputs={"regex": "[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", r.choices[0].text)
    r = engine.chat.completions.create(messages=MSGS, max_tokens=20, temperature=1.0, seed=2, n=3,
                                       structured_outputs={"choice": ["yes", "no", "maybe"]})
    assert all(c.message.content in ("yes", "no", "maybe") for c in r.choices)


def test_structured_output_streams_and_batches_with_free_requests(engine):
    import concurrent.futures as cf

    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}

    def constrained(seed):
        chunks = list(engine.chat.completions.create(messages=MSGS, max_tokens=400, temperature=1.0, seed=seed,
                                                     response_format=rf, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def free(seed):
        return engine.chat.completions.create(messages=MSGS, max_tokens=30, temperature=1.0, seed=seed,
                                              ignore_eos=True).usage.completion_tokens

    with cf.ThreadPoolExecutor(4) as ex:
        both = [ex.submit(constrained, s) for s in range(3)] + [ex.submit(free, s) for s in range(3)]
        results = [f.result() for f in both]
    for text in results[:3]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert results[3:] == [30, 30, 30]


def test_json_object_mode_gives_an_object(engine):
    r = engine.chat.completions.create(messages=MSGS, max_tokens=60, temperature=0.7, seed=3,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:   # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("bad, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_invalid_structured_requests_are_refused(engine, bad, param):
    with pytest.raises(RequestError) as e:
        engine.chat.completions.create(messages=MSGS, max_tokens=4, **bad)
    assert e.value.param.split(".")[0].split("[")[0] == param


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_and_validate(long_engine, choice):
    r = long_engine.chat.completions.create(messages=MSGS, max_tokens=1000, temperature=1.0, seed=4,
                                       tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
    assert isinstance(r, ChatCompletion)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_streamed_tool_call_deltas_accumulate_to_the_whole_call(long_engine):
    kw = dict(messages=MSGS, max_tokens=1000, temperature=1.0, seed=5, tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False)
    whole = long_engine.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in long_engine.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            acc = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            acc["id"] = acc["id"] or d.id
            acc["name"] += (d.function.name or "") if d.function else ""
            acc["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == whole[0].function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(whole[0].function.arguments)


def test_tool_result_turns_are_accepted_in_the_history(long_engine):
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    r = long_engine.chat.completions.create(messages=history, max_tokens=4, temperature=0, tools=[WEATHER],
                                            tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    # this template ignores tools: the model reads its earlier call as it was told to write it, and the result
    from mlcc.runtime.api import prepare, protocol

    call = prepare.chat_call(long_engine, protocol.parse_chat_request(
        {"messages": history, "tools": [WEATHER], "max_tokens": 4}).model_dump(exclude_none=True, by_alias=True))
    prompt = long_engine.tokenizer.decode(call.ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in prompt
    assert "18 degrees" in prompt and "<tools>" in prompt


def test_a_lone_constrained_request_decodes_pipelined_to_the_same_tokens(compiled):
    """The pipelined loop hands each token to the grammar before the next mask is drawn (DeviceDraw.after_token):
    the same outputs as the synchronous loop, greedy and seeded, with logit_bias too."""
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    outs = {}
    for pipeline in (False, True):
        with Engine(compiled("llama", "q0f32"), target="llvm", max_batch=2, pipeline=pipeline) as e:
            outs[pipeline] = [
                e.chat.completions.create(messages=MSGS, max_tokens=400, temperature=t, seed=s, response_format=rf,
                                          logit_bias={"65": 2.0}).choices[0].message.content
                for t, s in ((0, None), (1.0, 11))]
            if pipeline:
                assert e.core.stats["pipelined_tokens"] > 0
    assert outs[True] == outs[False]
    for text in outs[True]:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_logprobs_are_of_the_models_own_logits_under_a_logit_bias(engine, reference):
    """A bias changes what is sampled, not the reported distribution (vLLM's default, raw logprobs)."""
    forced = engine.tokenizer.encode("Z")[0]
    r = engine.chat.completions.create(messages=MSGS, max_tokens=1, temperature=0, logprobs=True, top_logprobs=1,
                                       logit_bias={str(forced): 100})
    t = r.choices[0].logprobs.content[0]
    row = _log_softmax(reference.forced(engine.encode_chat(MSGS), []))[0]
    assert bytes(t.bytes) == b"Z" and t.logprob == pytest.approx(row[forced], abs=1e-4)
    assert t.top_logprobs[0].logprob == pytest.approx(row.max(), abs=1e-4)

"""The OpenAI fields beyond plain sampling through a real `mlcc serve` process, driven by the official `openai`
client and its helpers: chat.completions.parse with a pydantic response_format, tool calls (whole, streamed
through the SDK's stream() helper and by hand), logprobs (chat, completions echo scoring), logit_bias, vLLM's
structured_outputs via extra_body, and the refusals as HTTP 400 in OpenAI's shape.

The model is the tiny random llama with a 2,048-token context (tool descriptions are long in its one-token-per-byte
vocabulary); every constrained field is bounded so that a random model completes within max_tokens."""

import json
import re
from enum import Enum
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_support import mlcc_serve

KEY = "sk-fields"
NAME = "tiny2k"
MSGS = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(compiled, tmp_path_factory):
    log = tmp_path_factory.mktemp("fields") / "server.log"
    with mlcc_serve(compiled("llama_2k", "q0f32"), log, "--api-key", KEY, "--max-batch", "4",
                    "--served-model-name", NAME) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what tokenizers' ByteLevel uses): byte -> the character naming it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@pytest.fixture(scope="module")
def byte_id(hf_models):
    """The model's tokenizer is byte-level with one token per byte: a byte -> its token id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_models("llama_2k") / "tokenizer.json"))
    chars = _bytes_to_unicode()
    return lambda b: tok.token_to_id(chars[b])


# -- chat.completions.parse with a pydantic model ----------------------------------------------------------------

class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    color: Color
    tags: list[Literal["cute", "old"]] = Field(max_length=2)
    vaccinated: bool


@pytest.mark.parametrize("seed", [0, 1])
def test_parse_gives_an_instance_of_the_pydantic_model(client, seed):
    r = client.chat.completions.parse(model=NAME, messages=MSGS, response_format=Pet, max_tokens=400,
                                      temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    pet = choice.message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.color, Color)
    assert len(pet.name) <= 8 and 0 <= pet.age <= 30 and len(pet.tags) <= 2
    assert Pet.model_validate_json(choice.message.content) == pet
    # the same seed, the same object
    again = client.chat.completions.parse(model=NAME, messages=MSGS, response_format=Pet, max_tokens=400,
                                          temperature=1.0, seed=seed)
    assert again.choices[0].message.parsed == pet


def test_the_sdk_stream_helper_parses_the_same_object(client):
    whole = client.chat.completions.parse(model=NAME, messages=MSGS, response_format=Pet, max_tokens=400,
                                          temperature=1.0, seed=1).choices[0].message
    partial = []
    with client.chat.completions.stream(model=NAME, messages=MSGS, response_format=Pet, max_tokens=400,
                                        temperature=1.0, seed=1) as stream:
        for event in stream:
            if event.type == "content.delta" and event.parsed is not None:
                partial.append(event.parsed)
        final = stream.get_final_completion().choices[0].message
    assert final.content == whole.content and final.parsed == whole.parsed
    assert partial and partial[-1] == whole.parsed.model_dump(mode="json")   # the SDK's partial-JSON snapshots


def test_json_object_and_raw_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=NAME, messages=MSGS, max_tokens=200, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "digit", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=60, temperature=0.7, seed=3,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:   # cut by max_tokens: still the start of an object
        assert text.lstrip().startswith("{")


# -- tool calls --------------------------------------------------------------------------------------------------

class GetWeather(BaseModel):
    """The weather in a city"""
    city: str = Field(max_length=12)
    unit: Literal["c", "f"]


class GetTime(BaseModel):
    zone: str = Field(max_length=8)


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")   # strict, as the SDK's helpers need
TIME = openai.pydantic_function_tool(GetTime, name="get_time")
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
TOOL_MODELS = {"get_weather": GetWeather, "get_time": GetTime}


def _check_call(call, name=None):
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in TOOLS and (name is None or call.function.name == name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[call.function.name]["function"]["parameters"])
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls(client, choice):
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=900, temperature=1.0, seed=4,
                                       tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    _check_call(c.message.tool_calls[0], name=choice["function"]["name"] if isinstance(choice, dict) else None)


def test_parse_gives_the_tool_arguments_as_the_tools_pydantic_model(client):
    r = client.chat.completions.parse(model=NAME, messages=MSGS, max_tokens=900, temperature=1.0, seed=7,
                                      tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                          "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content in (None, "")
    calls = c.message.tool_calls
    assert calls and all(call.function.name == "get_weather" for call in calls)   # parallel calls allowed
    assert len({call.id for call in calls}) == len(calls)
    for call in calls:
        args = _check_call(call, name="get_weather")
        assert isinstance(call.function.parsed_arguments, GetWeather)
        assert call.function.parsed_arguments == GetWeather.model_validate(args)


STREAM_KW = {"model": NAME, "messages": MSGS, "max_tokens": 900, "temperature": 1.0, "seed": 5,
             "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def whole_call(client):
    r = client.chat.completions.create(**STREAM_KW)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    return r.choices[0].message.tool_calls[0]


def test_sdk_stream_helper_accumulates_the_same_tool_call(client, whole_call):
    done_events = []
    with client.chat.completions.stream(**STREAM_KW) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.done":
                done_events.append(event)
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    args = _check_call(call)
    assert call.function.name == whole_call.function.name
    assert args == json.loads(whole_call.function.arguments)
    # a strict tool's arguments parsed into its pydantic model by the SDK, while streaming and at the end
    model = TOOL_MODELS[call.function.name]
    assert call.function.parsed_arguments == model.model_validate(args)
    assert [(e.name, e.index) for e in done_events] == [(call.function.name, 0)]
    assert done_events[0].parsed_arguments == model.model_validate(args)


def test_raw_streamed_tool_call_deltas_accumulate_to_the_whole_call(client, whole_call):
    calls: dict[int, dict] = {}
    finish, roles = None, []
    for chunk in client.chat.completions.create(stream=True, **STREAM_KW):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        for d in delta.tool_calls or []:
            acc = calls.setdefault(d.index, {"id": None, "type": None, "name": "", "arguments": ""})
            if d.id is not None:
                assert acc["id"] is None, "a call's id comes once"
                acc["id"] = d.id
            acc["type"] = acc["type"] or d.type
            if d.function is not None:
                acc["name"] += d.function.name or ""
                acc["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles[0] == "assistant"
    assert finish == "tool_calls" and list(calls) == [0]
    acc = calls[0]
    assert acc["id"].startswith("call_") and acc["type"] == "function"
    assert acc["name"] == whole_call.function.name
    assert json.loads(acc["arguments"]) == json.loads(whole_call.function.arguments)


def test_a_tool_result_turn_is_accepted_in_the_history(client, whole_call):
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [whole_call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": whole_call.id, "content": "18 degrees"}]
    r = client.chat.completions.create(model=NAME, messages=history, max_tokens=4, temperature=0,
                                       tools=[WEATHER, TIME], tool_choice="none")
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    # and a second forced call after the tool's answer
    r = client.chat.completions.create(model=NAME, messages=history, max_tokens=800, temperature=1.0, seed=6,
                                       tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                           "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls"
    _check_call(r.choices[0].message.tool_calls[0], name="get_weather")


# -- logprobs and logit_bias -------------------------------------------------------------------------------------

def test_chat_top_logprobs(client):
    kw = {"model": NAME, "messages": MSGS, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3,
          "extra_body": {"ignore_eos": True}}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)   # greedy: the top token
        assert t.top_logprobs[0].bytes == t.bytes and len(t.bytes) == 1          # one byte per token
    # the message is the tokens' bytes decoded (a UTF-8 sequence cut by max_tokens at the end is left out)
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace").startswith(
        r.choices[0].message.content)
    streamed = [t for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.bytes, round(t.logprob, 5)) for t in streamed] == [(t.bytes, round(t.logprob, 5)) for t in content]


def test_message_content_is_all_its_tokens_decoded(client):
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert bytes(content[-1].bytes) == b"\xa1"   # the greedy answer ends in a byte that cannot start a character
    assert r.choices[0].message.content == b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")


def test_completions_echo_scores_the_prompt_with_max_tokens_zero(client, byte_id):
    text = "The quick brown fox"
    r = client.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.text == text and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(text)
    lp = choice.logprobs
    assert lp.tokens == list(text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == list(range(len(text)))
    for j in range(1, len(text)):
        assert lp.token_logprobs[j] <= 0 and 1 <= len(lp.top_logprobs[j]) <= 3
        assert max(lp.top_logprobs[j].values()) >= lp.token_logprobs[j] - 1e-6
    # a token generated after the prompt (forced by logit_bias: logprobs are the model's own, before the bias)
    # has the logprob it gets when echoed as the prompt's last token
    q = byte_id(ord("Q"))
    gen = client.completions.create(model=NAME, prompt=text, max_tokens=1, temperature=0, logprobs=1,
                                    logit_bias={str(q): 100}, extra_body={"ignore_eos": True})
    g = gen.choices[0]
    assert g.text == "Q" and g.logprobs.tokens == ["Q"]
    scored = client.completions.create(model=NAME, prompt=text + "Q", max_tokens=0, echo=True, logprobs=1)
    slp = scored.choices[0].logprobs.token_logprobs
    assert slp[-1] == pytest.approx(g.logprobs.token_logprobs[0], abs=1e-4)
    assert slp[:-1] == pytest.approx(lp.token_logprobs, abs=1e-4)   # causal: the prefix scores the same
    # with echo and generated tokens both: the prompt's entries, then the generated ones
    both = client.completions.create(model=NAME, prompt=text, max_tokens=2, temperature=0, echo=True, logprobs=1,
                                     logit_bias={str(q): 100}, extra_body={"ignore_eos": True}).choices[0]
    assert both.text == text + "QQ" and both.logprobs.tokens == [*text, "Q", "Q"]
    assert both.logprobs.token_logprobs[:len(text) + 1] == pytest.approx(slp, abs=1e-4)


def test_logit_bias_forces_and_bans_a_token(client, byte_id):
    z = byte_id(ord("Z"))
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=5, temperature=0,
                                       logit_bias={str(z): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == "Z" * 5 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=1.0, seed=3,
                                  logit_bias={str(z): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "ZZZZ"
    kw = {"model": NAME, "messages": MSGS, "max_tokens": 1, "temperature": 0, "logprobs": True,
          "extra_body": {"ignore_eos": True}}
    free = client.chat.completions.create(**kw).choices[0].logprobs.content[0].bytes
    banned = client.chat.completions.create(**kw, logit_bias={str(byte_id(free[0])): -100})
    assert banned.choices[0].logprobs.content[0].bytes != free


# -- structured_outputs (vLLM's, through extra_body) -------------------------------------------------------------

def test_structured_outputs_regex(client):
    pattern = "[0-9]{3}-[a-c]{2}"
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=1.0, seed=1,
                                       extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=NAME, prompt="x", max_tokens=20, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].text)


def test_structured_outputs_choice(client):
    options = ["yes", "no", "maybe"]
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=1.0, seed=2, n=3,
                                       extra_body={"structured_outputs": {"choice": options}})
    assert len(r.choices) == 3 and all(c.message.content in options for c in r.choices)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=MSGS, max_tokens=20, temperature=1.0, seed=2, stream=True,
        extra_body={"structured_outputs": {"choice": options}}) if c.choices)
    assert streamed == r.choices[0].message.content   # choice 0 draws from seed 2, as a lone request does


# -- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, param, code", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", None),   # refused by the grammar compiler, with code "invalid_request_error"
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}},
     "tool_choice.function.name", "invalid_value"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field", "unknown_parameter"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs", None),
])
def test_refusals_are_400_in_openais_shape(client, bad, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=4, **bad)
    err = e.value
    assert err.status_code == 400
    assert set(err.body) == {"message", "type", "param", "code"} and err.body["message"]
    assert err.type == "invalid_request_error"
    assert err.param == param or err.param.startswith(param + ".") or err.param.startswith(param + "[")
    if code is not None:
        assert err.code == code
    assert client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2).choices   # still serving


def test_parse_refusal_of_an_unknown_tool_choice_and_still_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.parse(model=NAME, messages=MSGS, max_tokens=4, tools=[WEATHER],
                                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert e.value.param == "tool_choice.function.name"
    r = client.chat.completions.parse(model=NAME, messages=MSGS, response_format=Pet, max_tokens=400,
                                      temperature=1.0, seed=0)
    assert isinstance(r.choices[0].message.parsed, Pet)

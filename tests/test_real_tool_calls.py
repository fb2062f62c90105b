"""Tool calls on a real model through `mlcc serve` and the official openai client (marked slow: the
Qwen2.5-Coder-0.5B-Instruct GGUF of tests/test_real_weights.py, ~0.5 GB, and a minute or two of CPU compile).

Qwen writes `<tool_call>` and `</tool_call>` as single tokens; the 0.5B model left to itself (`auto`) writes the
untagged object instead. Each call's arguments must validate against the tool's JSON schema.

    python -m pytest -m slow -s tests/test_real_tool_calls.py
"""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from server_support import mlcc_serve
from test_real_weights import qwen_coder_gguf

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current local time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
                   "additionalProperties": False}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from openai import OpenAI

    from mlcc.compiler.build import compile_model

    out = tmp_path_factory.mktemp("qwen")
    t = time.perf_counter()
    compile_model(qwen_coder_gguf(), "llvm", "q4f32_1", out / "art")
    print(f"\ncompiled in {time.perf_counter() - t:.0f} s")
    with mlcc_serve(out / "art", out / "serve.log", "--max-batch", "1") as base:
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def _model(client) -> str:
    return client.models.list().data[0].id


def _check(calls, names: set[str]) -> list[tuple[str, dict]]:
    assert calls, "no tool calls"
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names, c.function.name
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, TOOLS[c.function.name]["function"]["parameters"])
        out.append((c.function.name, args))
    return out


def _ask(client, label: str, **kw):
    t = time.perf_counter()
    r = client.chat.completions.create(model=_model(client), temperature=0, max_tokens=120, **kw)
    c = r.choices[0]
    calls = [(x.function.name, x.function.arguments) for x in c.message.tool_calls or []]
    print(f"{label}: {time.perf_counter() - t:.1f} s, finish_reason={c.finish_reason}, "
          f"content={c.message.content!r}, tool_calls={calls}, completion_tokens={r.usage.completion_tokens}")
    return c


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_tool_choice_gives_valid_calls(client, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    c = _ask(client, choice, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert c.finish_reason == "tool_calls" and not c.message.content
    calls = _check(c.message.tool_calls, {"get_weather"})
    assert calls[0][1]["city"] == "Paris"
    if choice == "named":
        assert len(calls) == 1


def test_named_tool_is_the_one_called(client):
    c = _ask(client, "named get_time", messages=ASK, tools=[WEATHER, TIME],
             tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert c.finish_reason == "tool_calls"
    assert [n for n, _ in _check(c.message.tool_calls, {"get_time"})] == ["get_time"]


def test_a_tool_result_is_answered_in_text(client):
    """The call and its result go back as history (Qwen's template renders them as <tool_call> and
    <tool_response>). With the tools still offered this 0.5B model calls get_weather again, as transformers does on
    the same GGUF (greedy), so that reply is only checked to be well-formed; asked about the result with the tools
    no longer offered, it answers from the result in text."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    c = _ask(client, "tool result, tools offered", messages=history, tools=[WEATHER, TIME])
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        _check(c.message.tool_calls, set(TOOLS))
    else:
        assert c.finish_reason == "stop" and c.message.content
    c = _ask(client, "tool result, then a question", messages=[
        *history, {"role": "user", "content": "So what is the temperature there?"}])
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert "18" in c.message.content


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_deltas_reassemble_the_calls(client, choice):
    kw = {"model": _model(client), "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice,
          "temperature": 0, "max_tokens": 120}
    whole = client.chat.completions.create(**kw).choices[0]
    t = time.perf_counter()
    calls: dict[int, dict] = {}
    content, finish, n_chunks = "", None, 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        n_chunks += 1
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    print(f"stream {choice}: {time.perf_counter() - t:.1f} s, {n_chunks} chunks, finish_reason={finish}, "
          f"content={content!r}, tool_calls={got}")
    assert finish == "tool_calls" and not content.strip()
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    for name, args in got:
        jsonschema.validate(json.loads(args), TOOLS[name]["function"]["parameters"])


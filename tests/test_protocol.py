"""runtime.api.protocol: every request field's types, bounds and refusals, the error params in OpenAI's spelling, and
the JSON body parser's limits (depth, surrogates, encodings). Pure and fast: no model."""

import json

import pytest

from mlcc.errors import RequestError
from mlcc.runtime.api.json_body import check_values, json_depth
from mlcc.runtime.api.protocol import (
    MAX_DEPTH,
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)

MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def chat(**kw):
    return parse_chat_request({"messages": MSGS, **kw})


def refused(fn, body, param, code=None, match=None):
    with pytest.raises(RequestError) as e:
        fn(body)
    assert e.value.param == param, (e.value.param, str(e.value))
    if code:
        assert e.value.code == code, (e.value.code, str(e.value))
    if match:
        assert match in str(e.value), str(e.value)
    return e.value


def chat_refused(param, code=None, match=None, **kw):
    return refused(parse_chat_request, {"messages": MSGS, **kw}, param, code, match)


def completion_refused(param, code=None, match=None, **kw):
    return refused(parse_completion_request, {"prompt": "abc", **kw}, param, code, match)


# -- numbers and their bounds ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,ok,bad", [
    ("temperature", [0, 0.7, 2], [-0.1, 2.01, 9]),
    ("top_p", [1e-6, 0.5, 1], [0, -1, 1.5]),
    ("n", [1, 16], [0, 17]),
    ("presence_penalty", [-2, 0, 2.0], [-2.5, 3]),
    ("frequency_penalty", [-2, 2], [-3, 2.1]),
    ("repetition_penalty", [0.1, 1, 10], [0, -1, 10.5]),
    ("top_k", [-1, 0, 1, 40, 2**31 - 1], [-2, 2**31, 10**12, 10**5000]),
    ("seed", [-(2**63), 0, 2**63 - 1], [2**63, -(2**63) - 1, 10**30]),
    ("max_tokens", [1, 4096], [0, -5]),
    ("max_completion_tokens", [1, 100], [0]),
    ("top_logprobs", [0, 20], [-1, 21]),
])
def test_chat_number_bounds(field, ok, bad):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    for v in ok:
        assert getattr(chat(**{field: v}, **extra), field) == (0 if field == "top_k" and v == -1 else v)
    for v in bad:
        e = chat_refused(field, **{field: v}, **extra)
        assert e.code.endswith(("_min_value", "_max_value")), e.code


def test_number_errors_read_like_openai():
    e = chat_refused("temperature", "integer_above_max_value", temperature=9)
    assert "Expected a value <= 2" in str(e) and "got 9" in str(e)
    assert chat_refused("temperature", "decimal_below_min_value", temperature=-0.5).param == "temperature"
    assert "very large integer" in str(chat_refused("top_k", top_k=10**5000))   # never formats a huge int
    for bad in (float("nan"), float("inf"), float("-inf")):
        chat_refused("temperature", "invalid_value", temperature=bad)


@pytest.mark.parametrize("field,value,expected", [
    ("max_tokens", "10", "an integer"), ("max_tokens", 1.5, "an integer"), ("max_tokens", True, "an integer"),
    ("n", 2.0, "an integer"), ("seed", "1", "an integer"), ("top_k", [1], "an integer"),
    ("temperature", "0.5", "a number"), ("temperature", None if False else True, "a number"),
    ("top_p", {}, "a number"), ("stream", "yes", "a boolean"), ("stream", 1, "a boolean"),
    ("ignore_eos", 0, "a boolean"), ("logprobs", 1, "a boolean"), ("parallel_tool_calls", "true", "a boolean"),
    ("user", 5, "a string"), ("model", ["tiny"], "a string"), ("stream_options", [], "an object"),
    ("logit_bias", [], "an object"), ("tools", {}, "an array"), ("messages", "hi", "an array"),
    ("messages", {"role": "user"}, "an array"), ("stop_token_ids", 5, "an array"),
])
def test_wrong_types_are_invalid_type(field, value, expected):
    extra = {"tools": [TOOL]} if field == "parallel_tool_calls" else {}
    e = refused(parse_chat_request, {"messages": MSGS, **extra, field: value}, field, "invalid_type")
    assert f"expected {expected}" in str(e), str(e)


def test_integers_accept_floats_nowhere_but_floats_accept_integers():
    assert chat(temperature=1).temperature == 1
    assert chat(logit_bias={"5": -100}).logit_bias == {"5": -100.0}


# -- stop, logit_bias, stop_token_ids, stream_options, extras ----------------------------------------------------------

def test_stop_forms():
    assert chat(stop="x").stop == ["x"]
    assert chat(stop=["a", "b", "c", "d"]).stop == ["a", "b", "c", "d"]
    assert chat(stop=None).stop is None
    chat_refused("stop", stop=["a"] * 5)
    chat_refused("stop", stop="")
    chat_refused("stop", stop=["a", ""])
    chat_refused("stop[1]", "invalid_type", stop=["a", 3])


def test_logit_bias_keys_and_ranges():
    r = chat(logit_bias={"0": -100, "50256": 100, "7": 2.5})
    assert r.logit_bias_ids() == {0: -100.0, 50256: 100.0, 7: 2.5}
    assert chat(logit_bias={12: 1}).logit_bias_ids() == {12: 1.0}   # the Python API may key by int
    for bad in ({"x": 1}, {"-1": 1}, {"1.5": 1}, {"": 1}, {"99999999999": 1}, {"١": 1}):
        chat_refused("logit_bias", "invalid_value", match="token ids", logit_bias=bad)
    for bad in (100.5, -101):
        chat_refused("logit_bias", "invalid_value", match="[-100, 100]", logit_bias={"3": bad})
    chat_refused("logit_bias.3", "invalid_type", logit_bias={"3": "1"})
    chat_refused("logit_bias", "array_above_max_length", logit_bias={str(i): 1 for i in range(1025)})


def test_stop_token_ids_and_extras():
    r = chat(stop_token_ids=[0, 2, 2**31 - 1], ignore_eos=True, top_k=-1, repetition_penalty=1.1, user="u")
    assert r.stop_token_ids == [0, 2, 2**31 - 1] and r.ignore_eos and r.top_k == 0
    chat_refused("stop_token_ids[1]", "integer_below_min_value", stop_token_ids=[1, -1])
    chat_refused("stop_token_ids[0]", "invalid_type", stop_token_ids=["1"])
    chat_refused("stop_token_ids", "array_above_max_length", stop_token_ids=list(range(257)))


def test_stream_options_need_stream():
    assert chat(stream=True, stream_options={"include_usage": True}).stream_options.include_usage
    chat_refused("stream_options", "invalid_value", stream=False, stream_options={"include_usage": True})
    chat_refused("stream_options", "invalid_value", stream=None, stream_options={})
    # the engine takes stream as its own argument and validates the rest: stream left out is not refused
    assert chat(stream_options={"include_usage": True}).stream_options
    chat_refused("stream_options.foo", "unknown_parameter", stream=True, stream_options={"foo": 1})


@pytest.mark.parametrize("field", ["functions", "function_call", "metadata", "audio", "prediction",
                                   "reasoning_effort", "web_search_options", "min_tokens", "guided_json"])
def test_unsupported_openai_fields_are_named(field):
    e = chat_refused(field, "unsupported_parameter", **{field: {}})
    assert "not supported" in str(e)


def test_values_that_ask_for_nothing_missing_are_accepted():
    r = chat(store=False, service_tier="auto", modalities=["text"])
    assert r.store is False
    chat_refused("store", "invalid_value", store=True)
    chat_refused("service_tier", "invalid_value", service_tier="flex")
    chat_refused("modalities[1]", "invalid_value", modalities=["text", "audio"])


def test_unknown_fields_at_every_level():
    e = chat_refused("foo", "unknown_parameter", foo=1)
    assert str(e) == "Unknown parameter: 'foo'."
    refused(parse_chat_request, {"messages": [{"role": "user", "content": "x", "extra": 1}]},
            "messages[0].extra", "unknown_parameter")
    chat_refused("tools[0].function.extra", "unknown_parameter",
                 tools=[{"type": "function", "function": {"name": "f", "extra": 1}}])
    completion_refused("messages", "unknown_parameter", messages=MSGS)


def test_missing_required_fields():
    e = refused(parse_chat_request, {}, "messages", "missing_required_parameter")
    assert str(e) == "Missing required parameter: 'messages'."
    refused(parse_chat_request, {"prompt": "x"}, "messages", "missing_required_parameter")   # the missing one first
    refused(parse_completion_request, {"messages": MSGS}, "prompt", "missing_required_parameter")
    refused(parse_chat_request, [MSGS], None, "invalid_type")


# -- messages ------------------------------------------------------------------------------------------------------

def test_message_forms():
    r = parse_chat_request({"messages": [
        {"role": "system", "content": "s", "name": "sys"},
        {"role": "developer", "content": [{"type": "text", "text": "d"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": [{"type": "text", "text": "rain"}], "tool_call_id": "call_2"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": ""},
    ]})
    assert [m.role for m in r.messages] == ["system", "developer", "user", "assistant", "tool", "tool", "assistant",
                                             "user"]
    assert r.messages[3].tool_calls[1].function.arguments == "{\"a\": 1}"
    dumped = r.model_dump(exclude_unset=True, by_alias=True)
    assert parse_chat_request(dumped) == r and "refusal" not in dumped["messages"][3]


@pytest.mark.parametrize("message,param,code", [
    ({"role": ["user"], "content": "x"}, "messages[0].role", "invalid_type"),
    ({"role": "bob", "content": "x"}, "messages[0].role", "invalid_value"),
    ({"role": "function", "content": "x", "name": "f"}, "messages[0].role", "invalid_value"),
    ({"content": "x"}, "messages[0].role", "missing_required_parameter"),
    ({"role": "user"}, "messages[0].content", "missing_required_parameter"),
    ({"role": "user", "content": 5}, "messages[0].content", "invalid_type"),
    ({"role": "user", "content": None}, "messages[0].content", "invalid_type"),
    ({"role": "user", "content": {"type": "text", "text": "x"}}, "messages[0].content", "invalid_type"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text", "missing_required_parameter"),
    ({"role": "user", "content": [{"type": "text", "text": 1}]}, "messages[0].content[0].text", "invalid_type"),
    ({"role": "user", "content": ["x"]}, "messages[0].content[0]", "invalid_type"),
    ({"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content",
     "invalid_value"),
    ({"role": "user", "content": [{"type": "audio", "audio": {}}]}, "messages[0].content", "invalid_value"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]},
     "messages[0].content[0].image_url.url", "invalid_type"),
    ({"role": "user", "content": "x", "name": 3}, "messages[0].name", "invalid_type"),
    ({"role": "assistant"}, "messages[0].content", "invalid_value"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages[0].content", "invalid_value"),
    ({"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]},
     "messages[0].tool_calls[0].function.arguments", "missing_required_parameter"),
    ({"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                           "function": {"name": "f", "arguments": {"a": 1}}}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    ({"role": "assistant", "tool_calls": [{"id": "1", "type": "code", "function": {"name": "f", "arguments": ""}}]},
     "messages[0].tool_calls[0].type", "invalid_value"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({"role": "tool", "content": "x", "tool_call_id": "1"}, "messages[0].role", "invalid_value"),
    ({"role": "system", "content": None}, "messages[0].content", "invalid_type"),
])
def test_bad_messages(message, param, code):
    refused(parse_chat_request, {"messages": [message]}, param, code)


def test_message_list_and_order():
    refused(parse_chat_request, {"messages": []}, "messages", "empty_array")
    call = {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                 "function": {"name": "f", "arguments": "{}"}}]}
    refused(parse_chat_request, {"messages": [*MSGS, call, {"role": "tool", "content": "r", "tool_call_id": "b"}]},
            "messages[2].tool_call_id", "invalid_value")
    # a tool answer must follow the calls, not a later user turn
    refused(parse_chat_request, {"messages": [call, *MSGS, {"role": "tool", "content": "r", "tool_call_id": "a"}]},
            "messages[2].role", "invalid_value")
    e = refused(parse_chat_request, {"messages": [*MSGS, *MSGS, {"role": "x", "content": ""}]}, "messages[2].role")
    assert "'system', 'developer', 'user', 'assistant', 'tool'" in str(e)


# -- tools ---------------------------------------------------------------------------------------------------------

def test_tools_and_tool_choice():
    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        assert chat(tools=[TOOL], tool_choice=choice, parallel_tool_calls=False).tools[0].function.name == \
            "get_weather"
    assert chat(tool_choice="none").tool_choice == "none"
    chat_refused("tool_choice", "invalid_value", tool_choice="auto")
    chat_refused("tool_choice", "invalid_value", tool_choice={"type": "function", "function": {"name": "f"}})
    chat_refused("parallel_tool_calls", "invalid_value", parallel_tool_calls=True)
    chat_refused("tool_choice.function.name", "invalid_value", tools=[TOOL],
                 tool_choice={"type": "function", "function": {"name": "nope"}})
    chat_refused("tool_choice", "invalid_value", tools=[TOOL], tool_choice="sometimes")
    chat_refused("tool_choice.function", "missing_required_parameter", tools=[TOOL], tool_choice={"type": "function"})


@pytest.mark.parametrize("tool,param,code", [
    ({"type": "function"}, "tools[0].function", "missing_required_parameter"),
    ({"type": "retrieval", "function": {"name": "f"}}, "tools[0].type", "invalid_value"),
    ({"type": "function", "function": {}}, "tools[0].function.name", "missing_required_parameter"),
    ({"type": "function", "function": {"name": "has space"}}, "tools[0].function.name", "invalid_value"),
    ({"type": "function", "function": {"name": "x" * 65}}, "tools[0].function.name", "invalid_value"),
    ({"type": "function", "function": {"name": "f", "parameters": []}}, "tools[0].function.parameters",
     "invalid_type"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
     "tools[0].function.parameters", "invalid_value"),
    ({"type": "function", "function": {"name": "f", "strict": "yes"}}, "tools[0].function.strict", "invalid_type"),
])
def test_bad_tools(tool, param, code):
    chat_refused(param, code, tools=[tool])


def test_tool_limits():
    assert len(chat(tools=[{"type": "function", "function": {"name": f"t{i}"}} for i in range(128)]).tools) == 128
    chat_refused("tools", "array_above_max_length",
                 tools=[{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)])
    chat_refused("tools[1].function.name", "invalid_value", tools=[TOOL, TOOL])


# -- response_format, structured_outputs, logprobs -------------------------------------------------------------------

def test_response_format_variants():
    assert chat(response_format={"type": "text"}).response_format.type == "text"
    assert chat(response_format={"type": "json_object"}).response_format.type == "json_object"
    r = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "description": "d", "strict": True, "schema": {"type": "object"}}})
    assert r.response_format.json_schema.schema_ == {"type": "object"}
    assert r.model_dump(exclude_unset=True, by_alias=True)["response_format"]["json_schema"]["schema"] == \
        {"type": "object"}
    chat_refused("response_format.type", "invalid_value", response_format={"type": "xml"})
    chat_refused("response_format.type", "missing_required_parameter", response_format={})
    chat_refused("response_format.json_schema", "missing_required_parameter", response_format={"type": "json_schema"})
    chat_refused("response_format.json_schema.name", "missing_required_parameter",
                 response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    chat_refused("response_format.json_schema.name", "invalid_value",
                 response_format={"type": "json_schema", "json_schema": {"name": "a/b"}})
    chat_refused("response_format.json_schema.schema", "invalid_type",
                 response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": "object"}})
    chat_refused("response_format.schema", "unknown_parameter",
                 response_format={"type": "json_object", "schema": {}})


def test_structured_outputs():
    for so in ({"json": {"type": "object"}}, {"regex": "[a-z]+"}, {"choice": ["yes", "no"]},
               {"grammar": "root ::= \"a\""}):
        assert parse_completion_request({"prompt": "x", "structured_outputs": so}).structured_outputs
    completion_refused("structured_outputs", "invalid_value", structured_outputs={})
    completion_refused("structured_outputs", "invalid_value", structured_outputs={"regex": "a", "choice": ["a"]})
    completion_refused("structured_outputs.choice", "empty_array", structured_outputs={"choice": []})
    completion_refused("structured_outputs.xml", "unknown_parameter", structured_outputs={"xml": "x"})
    chat_refused("structured_outputs", "invalid_value", structured_outputs={"regex": "a"},
                 response_format={"type": "json_object"})
    assert chat(structured_outputs={"regex": "a"}, response_format={"type": "text"})
    chat_refused("tool_choice", "invalid_value", tools=[TOOL], tool_choice="required",
                 response_format={"type": "json_object"})


def test_logprobs():
    assert chat(logprobs=True, top_logprobs=5).top_logprobs == 5
    assert chat(logprobs=True).top_logprobs is None
    chat_refused("top_logprobs", "invalid_value", top_logprobs=2)
    chat_refused("top_logprobs", "invalid_value", logprobs=False, top_logprobs=2)
    assert parse_completion_request({"prompt": "x", "logprobs": 20}).logprobs == 20
    completion_refused("logprobs", "integer_above_max_value", logprobs=21)
    completion_refused("logprobs", "invalid_type", logprobs=True)


# -- completions -----------------------------------------------------------------------------------------------------

def test_completion_prompt_forms():
    assert parse_completion_request({"prompt": "abc"}).prompt == "abc"
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion_request({"prompt": ["abc"]}).prompt == "abc"          # a batch of one
    assert parse_completion_request({"prompt": [[4, 5]]}).prompt == [4, 5]
    refused(parse_completion_request, {"prompt": ["a", "b"]}, "prompt", "invalid_value")
    refused(parse_completion_request, {"prompt": [[1], [2]]}, "prompt", "invalid_value")
    refused(parse_completion_request, {"prompt": []}, "prompt", "invalid_value")
    refused(parse_completion_request, {"prompt": [1, -1]}, "prompt[1]", "integer_below_min_value")
    refused(parse_completion_request, {"prompt": [[1, 2**31]]}, "prompt[0][1]", "integer_above_max_value")
    refused(parse_completion_request, {"prompt": 5}, "prompt", "invalid_type")
    refused(parse_completion_request, {"prompt": None}, "prompt", "invalid_type")


def test_completion_fields():
    r = parse_completion_request({"prompt": "x", "echo": True, "max_tokens": 0, "n": 2, "best_of": 2})
    assert r.max_tokens == 0 and r.echo
    completion_refused("max_tokens", "invalid_value", max_tokens=0)
    completion_refused("max_tokens", "integer_below_min_value", max_tokens=-1)
    completion_refused("suffix", "unsupported_parameter", suffix="tail")
    assert parse_completion_request({"prompt": "x", "suffix": ""}).suffix == ""
    completion_refused("best_of", "unsupported_value", best_of=3)
    completion_refused("echo", "invalid_type", echo="yes")
    completion_refused("tools", "unknown_parameter", tools=[TOOL])


# -- strings and nesting ---------------------------------------------------------------------------------------------

def test_lone_surrogates_are_refused_where_they_are():
    refused(parse_chat_request, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content",
            "invalid_value")
    refused(parse_chat_request, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages[0].content[0].text", "invalid_value")
    chat_refused("stop[1]", stop=["ok", "\udc80"])
    chat_refused("user", user="\ud83d")
    chat_refused("logit_bias", logit_bias={"\ud800": 1})
    assert chat(user="\U0001f600 é 中").user == "\U0001f600 é 中"   # a real astral character is fine


def test_depth_limit_on_python_requests():
    deep: object = "x"
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    chat_refused("tools", "invalid_json", tools=[{"type": "function", "function": {"name": "f",
                                                                                   "parameters": {"a": deep}}}])
    chat_refused("unknown", "invalid_json", unknown=deep)   # before the unknown field is even looked at
    very_deep: object = {}
    for _ in range(100_000):
        very_deep = {"a": very_deep}
    chat_refused("x", "invalid_json", x=very_deep)
    ok: object = {"type": "object"}
    for _ in range(20):
        ok = {"type": "object", "properties": {"a": ok}}
    assert chat(tools=[{"type": "function", "function": {"name": "f", "parameters": ok}}])
    check_values([[[1]]], max_depth=3)
    with pytest.raises(RequestError):
        check_values([[[[1]]]], max_depth=3)


# -- the JSON body parser --------------------------------------------------------------------------------------------

def test_parse_json_body_accepts_ordinary_bodies():
    body = {"messages": [{"role": "user", "content": "brackets [{ in \" strings }] \\ and \U0001f600"}]}
    assert parse_json_body(json.dumps(body).encode()) == body
    assert parse_json_body(json.dumps(body, ensure_ascii=False).encode()) == body
    assert parse_json_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}   # an escaped pair is one character


@pytest.mark.parametrize("body,match", [
    (b"[" * 100_000 + b"]" * 100_000, "nested 100000 levels"),
    (b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested 1001 levels"),
    (b'{"messages": [], "unknown": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}", "nested"),
    (b"[" * 100_000, "nested"),                 # unbalanced too
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": -Infinity}', "Infinity"),
    (b'{"a": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b"\xff\xfe{}", "UTF-8"),
    (b'{"a": "\xed\xa0\x80"}', "UTF-8"),        # a surrogate encoded as UTF-8
    (b'{"a": "\xc3"}', "UTF-8"),
    (b"\xef\xbb\xbf{}", "BOM"),
    (b"[1, 2]", "an array"),
    (b'"text"', "a string"),
    (b"null", "null"),
    (b"42", "an integer"),
])
def test_parse_json_body_refusals(body, match):
    with pytest.raises(RequestError) as e:
        parse_json_body(body)
    assert e.value.code == "invalid_json" and match in str(e.value), str(e.value)


def test_parse_json_body_names_the_surrogate_field():
    with pytest.raises(RequestError) as e:
        parse_json_body(b'{"messages": [{"role": "user", "content": "a\\ud800"}]}')
    assert e.value.param == "messages[0].content" and e.value.code == "invalid_value"
    with pytest.raises(RequestError):
        parse_json_body(b'{"\\udc00": 1}')


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth(b'{"a": [{"b": "]]]]"}]}') == 3
    assert json_depth(b'["\\\\", [[["x"]]]]') == 4            # an escaped backslash does not escape the quote
    assert json_depth(b'["\\"[[[[", []]') == 2
    assert json_depth(b'"' + b'\\"' * 100_000) == 0            # an unterminated string of escaped quotes: linear
    assert json_depth(b"[]" * 100_000) == 1
    assert json_depth(b"[1]", stop_above=64) <= 64


def test_schema_documents_the_fields():
    chat_schema = json.dumps(ChatCompletionRequest.model_json_schema())
    for field in ("messages", "tools", "tool_choice", "response_format", "logprobs", "top_logprobs", "logit_bias",
                  "structured_outputs", "tool_call_id", "json_schema", "max_completion_tokens"):
        assert f'"{field}"' in chat_schema, field
    completion_schema = CompletionRequest.model_json_schema()
    assert {"prompt", "echo", "logprobs", "best_of"} <= set(completion_schema["properties"])
    assert completion_schema["additionalProperties"] is False

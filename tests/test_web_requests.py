"""The web engine's request checks (web/js/request_check.js) against protocol's: the committed schema is the one
protocol's pydantic model gives, and hostile requests are refused naming the same field as parse_chat_request.
Needs only node (no GPU, no site). `mlcc export-request-schema` rewrites web/js/request_schema.js."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from mlcc.cli import main, request_schema_js
from mlcc.errors import RequestError
from mlcc.web.request_schema import JS_FILE

M = [{"role": "user", "content": "hi"}]
# (request, why it is refused): each one protocol refuses too, with the same param
REFUSED = [
    {"messages": M, "foo": 1},
    {"messages": M, "temperature": "hot"},
    {"messages": M, "temperature": 3},
    {"messages": M, "top_p": 0},
    {"messages": M, "max_tokens": 1.5},
    {"messages": M, "max_tokens": 0},
    {"messages": M, "seed": "1"},
    {"messages": M, "stream": 1},
    {"messages": M, "stream": True, "stream_options": {"include_usage": 1}},
    {"messages": M, "stream": True, "stream_options": {"bogus": True}},
    {"messages": M, "stream": False, "stream_options": {"include_usage": True}},
    {"messages": M, "stream": None, "stream_options": {"include_usage": True}},
    {"messages": M, "stop": ["a", "b", "c", "d", "e"]},
    {"messages": M, "stop": [""]},
    {"messages": M, "stop": 5},
    {"messages": M, "logit_bias": {"a": 1}},
    {"messages": M, "logit_bias": {"5": 1000}},
    {"messages": M, "logit_bias": {"5": "x"}},
    {"messages": M, "logprobs": "yes"},
    {"messages": M, "top_logprobs": 2},
    {"messages": M, "logprobs": True, "top_logprobs": 21},
    {"messages": M, "functions": []},
    {"messages": M, "metadata": {}},
    {"messages": M, "n": 17},
    {"messages": M, "tool_choice": "required"},
    {"messages": M, "parallel_tool_calls": True},
    {"messages": M, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
    {"messages": M, "response_format": {"type": "xml"}},
    {"messages": M, "response_format": {"type": "json_schema"}},
    {"messages": M, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    {"messages": M, "structured_outputs": {"json": {}, "regex": "a"}},
    {"messages": M, "structured_outputs": {"choice": []}},
    {"messages": M, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
    {"messages": M, "store": True},
    {"messages": M, "service_tier": "flex"},
    {"messages": []},
    {"messages": "hi"},
    {},
    {"messages": [{"role": "bot", "content": "x"}]},
    {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": "x", "extra": 1}]},
    {"messages": [{"role": "assistant"}]},
    {"messages": [*M, {"role": "tool", "content": "x", "tool_call_id": "a"}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                        "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "x", "tool_call_id": "b"}]},
    {"messages": M, "top_k": 1.5},
    {"messages": M, "repetition_penalty": 0},
    {"messages": M, "stop_token_ids": [-1]},
]
ACCEPTED = [
    {"messages": M},
    {"messages": M, "temperature": 0, "top_p": 0.5, "seed": -5, "stop": "x", "max_tokens": 3, "user": "u",
     "presence_penalty": 1, "frequency_penalty": -1.5, "logit_bias": {"5": -100}, "logprobs": True,
     "top_logprobs": 0, "stream": True, "stream_options": {"include_usage": True}, "n": 1, "model": "m",
     "max_completion_tokens": 4, "top_k": -1, "repetition_penalty": 1.1, "ignore_eos": False,
     "stop_token_ids": [1], "store": False, "service_tier": "auto", "modalities": ["text"]},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "a"}]}, {"role": "developer", "content": "b"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "r", "tool_call_id": "c"}, {"role": "user", "content": "d", "name": "n"}]},
    {"messages": M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                               "strict": True}}},
    {"messages": M, "structured_outputs": {"choice": ["a", "b"]}},
]


def test_request_schema_is_current():
    assert JS_FILE.read_text() == request_schema_js(), \
        "web/js/request_schema.js is stale: regenerate it with `mlcc export-request-schema`"


def test_export_request_schema_check_passes_on_the_committed_file(capsys):
    assert main(["export-request-schema", "--check"]) == 0
    assert "is current" in capsys.readouterr().out


def js_verdicts(requests: list[dict]) -> list[dict]:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    script = ("import { parseChatRequest } from './request_check.js';"
              "import { readFileSync } from 'node:fs';"
              "const out = JSON.parse(readFileSync(0, 'utf8')).map((r) => {"
              " try { parseChatRequest(r); return { ok: true }; }"
              " catch (e) { return { name: e.name, param: e.param, code: e.code, message: e.message }; } });"
              "console.log(JSON.stringify(out));")
    proc = subprocess.run(["node", "--input-type=module", "-e", script], check=False, cwd=JS_FILE.parent,
                          input=json.dumps(requests),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def py_verdict(req: dict) -> dict:
    from mlcc.runtime.api.protocol import parse_chat_request

    try:
        parse_chat_request(req)
        return {"ok": True}
    except RequestError as e:
        return {"param": e.param, "message": str(e)}


def test_js_checks_refuse_what_protocol_refuses_naming_the_same_field():
    got = js_verdicts(REFUSED + ACCEPTED)
    wrong = []
    for req, js in zip(REFUSED, got):
        py = py_verdict(req)
        assert "param" in py, f"protocol accepts {req}"
        if js.get("name") != "EngineError" or js["param"] != py["param"] or not js["message"]:
            wrong.append((req, js, py))
    assert not wrong, "\n".join(map(str, wrong))
    for req, js in zip(ACCEPTED, got[len(REFUSED):]):
        assert py_verdict(req) == {"ok": True}, req
        assert js == {"ok": True}, (req, js)


def test_js_checks_unknown_fields_and_types_name_the_field():
    unknown, wrong_type, deep = js_verdicts([
        {"messages": M, "frobnicate": True},
        {"messages": M, "presence_penalty": "high"},
        {"messages": M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "a": {"b": {"c": {"d": [1, {"e": "\ud800"}]}}}}}}},
    ])
    assert unknown["param"] == "frobnicate" and unknown["code"] == "unknown_parameter"
    assert "'frobnicate'" in unknown["message"]
    assert wrong_type["param"] == "presence_penalty" and wrong_type["code"] == "invalid_type"
    assert "expected" in wrong_type["message"] and "a string" in wrong_type["message"]
    assert deep["param"] == "response_format.json_schema.schema.a.b.c.d[1].e"
    assert "surrogate" in deep["message"]


def test_web_support_refuses_what_the_web_engine_cannot_do():
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    cases = [({"messages": M, "n": 2}, "n"),
             ({"messages": M, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
             ({"messages": M, "response_format": {"type": "json_object"}}, "response_format"),
             ({"messages": M, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
             ({"messages": M, "logit_bias": {"320": 1}}, "logit_bias"),
             ({"messages": M, "stop_token_ids": [400]}, "stop_token_ids")]
    script = ("import { parseChatRequest, checkWebSupport } from './request_check.js';"
              "import { readFileSync } from 'node:fs';"
              "const [cases, lark] = JSON.parse(readFileSync(0, 'utf8'));"
              "const run = (r, grammars) => { try { checkWebSupport(parseChatRequest(r), { vocab: 320, grammars });"
              " return null; } catch (e) { return [e.param, e.code, e.message]; } };"
              "console.log(JSON.stringify([...cases.map((r) => run(r, false)), run(lark, true),"
              " run(cases[3], true)]));")
    lark = {"messages": M, "structured_outputs": {"grammar": "start: \"a\""}}
    proc = subprocess.run(["node", "--input-type=module", "-e", script], check=False, cwd=JS_FILE.parent,
                          input=json.dumps([[c for c, _ in cases], lark]), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    *got, lark_got, regex_with_grammars = json.loads(proc.stdout)
    for (req, param), g in zip(cases, got):
        assert g is not None and g[0] == param, (req, g)
        assert "web engine" in g[2] or "vocabulary" in g[2], g
    assert lark_got[0] == "structured_outputs.grammar" and "Lark" in lark_got[2]
    assert regex_with_grammars is None

"""Hostile input against a real `mlcc serve`: one test per class of bad request. Each is answered with a 4xx in
OpenAI's shape ({"error": {"message", "type", "param", "code"}}, nothing of FastAPI's own), and after each the
server still answers an ordinary request."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_support import mlcc_serve

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
MSGS = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(compiled, tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    with mlcc_serve(compiled("llama", "q0f32"), log, "--api-key", KEY, "--max-batch", "4",
                    "--served-model-name", "tiny") as base:
        yield base


@pytest.fixture(autouse=True)
def still_serving(server):
    yield
    r = httpx.post(f"{server}/v1/chat/completions", headers=JSON, timeout=60,
                   json={"model": "tiny", "messages": MSGS, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def post(server: str, body: bytes | dict, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server}{path}", content=content, headers=kw.pop("headers", JSON), timeout=60, **kw)


def openai_error(r: httpx.Response, status: int, param: str | None = "any", code: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


def test_lone_surrogate_in_content(server):
    raw = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 2}'
    openai_error(post(server, raw), 400, "messages[0].content", "invalid_value")
    raw = b'{"prompt": "\\udfff", "max_tokens": 2}'
    openai_error(post(server, raw, "/v1/completions"), 400, "prompt")
    raw = b'{"messages": [{"role": "user", "content": "x"}], "stop": ["\\udc00"]}'
    openai_error(post(server, raw), 400, "stop[0]")


def test_list_as_role(server):
    err = openai_error(post(server, {"messages": [{"role": ["user"], "content": "x"}]}), 400, "messages[0].role",
                       "invalid_type")
    assert "expected a string" in err["message"]
    openai_error(post(server, {"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages[0].role",
                 "invalid_value")


@pytest.mark.parametrize("field,value", [("top_k", 10**12), ("seed", 2**64), ("max_tokens", 10**30),
                                         ("n", 10**6), ("logit_bias", {"99999999999999": 1}),
                                         ("temperature", 1e308), ("top_k", -(10**12))])
def test_huge_numbers(server, field, value):
    openai_error(post(server, {"messages": MSGS, field: value}), 400, field)


def test_numbers_json_cannot_hold(server):
    openai_error(post(server, b'{"messages": [], "temperature": NaN}'), 400, None, "invalid_json")
    openai_error(post(server, b'{"messages": [], "temperature": 1e999}'), 400, "temperature")
    openai_error(post(server, b'{"messages": [], "seed": 1' + b"0" * 10_000 + b"}"), 400, None, "invalid_json")


@pytest.mark.parametrize("levels", [1_000, 100_000])
@pytest.mark.parametrize("where", ["body", "content", "unknown", "tool_schema"])
def test_deep_nesting(server, levels, where):
    deep = b"[" * levels + b"]" * levels
    body = {
        "body": deep,
        "content": b'{"messages": [{"role": "user", "content": ' + deep + b"}]}",
        "unknown": b'{"messages": [{"role": "user", "content": "x"}], "zzz": ' + deep + b"}",
        "tool_schema": b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                       b'"function": {"name": "f", "parameters": {"type": "object", "x": ' + deep + b"}}}]}",
    }[where]
    err = openai_error(post(server, body), 400, None, "invalid_json")
    assert "nested" in err["message"]


def test_unknown_fields(server):
    err = openai_error(post(server, {"messages": MSGS, "frobnicate": True}), 400, "frobnicate", "unknown_parameter")
    assert err["message"] == "Unknown parameter: 'frobnicate'."
    openai_error(post(server, {"messages": [{"role": "user", "content": "x", "mood": "grumpy"}]}), 400,
                 "messages[0].mood", "unknown_parameter")
    openai_error(post(server, {"prompt": "x", "messages": MSGS}, "/v1/completions"), 400, "messages",
                 "unknown_parameter")
    openai_error(post(server, {"messages": MSGS, "functions": []}), 400, "functions", "unsupported_parameter")


@pytest.mark.parametrize("field,value", [
    ("messages", "hi"), ("messages", {"role": "user"}), ("messages", [5]), ("messages", []),
    ("max_tokens", "ten"), ("max_tokens", 2.5), ("max_tokens", True), ("temperature", "hot"), ("top_p", []),
    ("n", "2"), ("stream", "yes"), ("stream", 1), ("stop", 7), ("stop", [1]), ("seed", 1.5),
    ("logit_bias", ["5"]), ("logit_bias", {"5": "x"}), ("stream_options", "on"), ("tools", "all"),
    ("tool_choice", 3), ("response_format", "json"), ("response_format", {"type": 1}), ("logprobs", "yes"),
    ("top_logprobs", 2.0), ("user", {}), ("model", 5), ("ignore_eos", "no"), ("stop_token_ids", ["1"]),
])
def test_wrong_types(server, field, value):
    err = openai_error(post(server, {"messages": MSGS, field: value}), 400)
    assert err["param"] is not None and err["param"].split("[")[0].split(".")[0] == field, err


@pytest.mark.parametrize("field,value", [("prompt", 5), ("prompt", [1.5]), ("prompt", [["a"]]), ("echo", "yes"),
                                         ("logprobs", True), ("best_of", "2"), ("suffix", 1)])
def test_wrong_types_for_completions(server, field, value):
    body = {"prompt": "abc", field: value} if field != "prompt" else {"prompt": value}
    err = openai_error(post(server, body, "/v1/completions"), 400)
    assert err["param"].split("[")[0] == field, err


@pytest.mark.parametrize("raw", [b"\xff\xfe\x00{}", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
                                 b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', b"\x80"])
def test_invalid_utf8(server, raw):
    err = openai_error(post(server, raw), 400, None, "invalid_json")
    assert "UTF-8" in err["message"]


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"hello"', b"42", b"null", b"true", b"", b"   ", b"{", b"{}}",
                                 b"\xef\xbb\xbf{}"])
def test_non_object_bodies(server, raw):
    openai_error(post(server, raw), 400, None, "invalid_json")
    openai_error(post(server, raw, "/v1/completions"), 400, None, "invalid_json")


def test_huge_bodies(server):
    big = b'{"messages": [], "x": "' + b"a" * (5 << 20) + b'"}'
    openai_error(post(server, big), 413, None, "request_too_large")

    def chunked():   # no content-length: counted as it arrives
        for _ in range(6):
            yield b" " * (1 << 20)

    r = httpx.post(f"{server}/v1/chat/completions", content=chunked(), headers=JSON, timeout=60)
    openai_error(r, 413, None, "request_too_large")
    # just under the limit: read, parsed, refused for what it says (not a 5xx, not a hang)
    r = post(server, b" " * ((4 << 20) - 100) + b'{"prompt": "x"}')
    openai_error(r, 400, "messages", "missing_required_parameter")


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/nothing", 404), ("POST", "/v1/nothing", 404), ("GET", "/", 404),
    ("POST", "/v1/chat/completion", 404), ("GET", "/v1/chat/completions", 405),
    ("PUT", "/v1/completions", 405), ("DELETE", "/v1/models", 405), ("POST", "/health", 405),
])
def test_unknown_paths_and_wrong_methods(server, method, path, status):
    r = httpx.request(method, f"{server}{path}", headers=JSON, content=b"{}", timeout=30)
    err = openai_error(r, status, None)
    assert err["code"] == ("unknown_url" if status == 404 else "method_not_allowed")
    assert path in err["message"]
    if status == 405:
        assert "POST" in r.headers.get("allow", "") or "GET" in r.headers.get("allow", "")


def test_model_not_found(server):
    openai_error(post(server, {"model": "gpt-17", "messages": MSGS}), 404, "model", "model_not_found")
    openai_error(post(server, {"model": "gpt-17", "prompt": "x"}, "/v1/completions"), 404, "model",
                 "model_not_found")
    openai_error(httpx.get(f"{server}/v1/models/gpt-17", headers=AUTH), 404, "model", "model_not_found")
    assert httpx.get(f"{server}/v1/models/tiny", headers=AUTH).json()["id"] == "tiny"


def test_missing_api_key_is_401_in_shape(server):
    openai_error(httpx.post(f"{server}/v1/chat/completions", json={"messages": MSGS}), 401, None, "invalid_api_key")
    openai_error(httpx.get(f"{server}/v1/nothing"), 401, None, "invalid_api_key")


def test_engine_refusals_keep_the_shape(server):
    openai_error(post(server, {"prompt": [1, 10**6], "max_tokens": 2}, "/v1/completions"), 400, "prompt")
    openai_error(post(server, {"messages": [{"role": "user", "content": "y" * 3000}]}), 400, "messages",
                 "context_length_exceeded")


def test_a_flood_of_hostile_requests_leaves_it_serving(server):
    bodies = [b"[" * 100_000, b'{"messages": "x"}', b"\xff", b'{"messages": [{"role": [1]}]}',
              b'{"messages": [], "top_k": 1000000000000}', b'{"x": "\\ud800"}'] * 5

    def one(b):
        return post(server, b).status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(one, bodies)) == {400}
    metrics = httpx.get(f"{server}/metrics", headers=AUTH).text
    assert 'endpoint="/v1/nothing"' not in metrics   # unknown paths share one label

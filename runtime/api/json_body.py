"""Request JSON without recursion: a depth-limited, surrogate-refusing body parser and the same checks for a
Python request, so a hostile body is a RequestError (400), never a RecursionError or a tokenizer crash."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from mlcc.errors import RequestError

MAX_DEPTH = 64            # JSON nesting of a body or a Python request; tool schemas live well inside it

_SURROGATE = re.compile("[\ud800-\udfff]")


def param_path(path: tuple[Any, ...]) -> str | None:
    """A field path as OpenAI writes it: messages[0].content[1].text."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def kind_of(v: Any) -> str:
    """A JSON value's kind as an error message names it."""
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    (dict, "an object"), (list, "an array"), (tuple, "an array"), (type(None), "null")):
        if isinstance(v, t):
            return name
    return f"a {type(v).__name__}"


def check_values(obj: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than max_depth and strings (values or keys) holding lone UTF-16 surrogates, which
    no tokenizer can encode; the param names where."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(obj, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise RequestError(f"'{param_path(path) or 'body'}' holds a lone UTF-16 surrogate, which is not text",
                                   param=param_path(path), code="invalid_value")
            continue
        if isinstance(v, (dict, list, tuple)):
            if len(path) >= max_depth:
                raise RequestError(f"the request is nested deeper than {max_depth} levels at '{param_path(path)}'",
                                   param=param_path(path[:1]) or None, code="invalid_json")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str) and _SURROGATE.search(k):
                    raise RequestError(f"a key in '{param_path(path) or 'body'}' holds a lone UTF-16 surrogate",
                                       param=param_path(path) or None, code="invalid_value")
                stack.append((x, (*path, k)))


def json_depth(body: bytes, stop_above: int | None = None) -> int:
    """The deepest bracket nesting of a JSON text, brackets inside strings aside: vectorised, linear, no recursion
    (and no regex, whose retries on an unterminated string of escaped quotes are quadratic). stop_above: a bound
    that, when the brackets are too few to pass it, returns their count at once (the common case costs a count)."""
    opens = body.count(b"[") + body.count(b"{")
    if stop_above is not None and opens <= stop_above:
        return opens
    b = np.frombuffer(body, np.uint8)
    idx = np.arange(b.size, dtype=np.int64 if b.size >= 1 << 31 else np.int32)
    # a quote ends or starts a string unless an odd run of backslashes precedes it
    last_plain = np.maximum.accumulate(np.where(b == ord("\\"), -1, idx))
    run = idx - 1 - np.concatenate(([-1], last_plain[:-1]))
    quote = (b == ord('"')) & (run % 2 == 0)
    outside = np.cumsum(quote, dtype=idx.dtype) % 2 == 0
    steps = (((b == ord("[")) | (b == ord("{"))) & outside).astype(np.int8)
    steps -= (((b == ord("]")) | (b == ord("}"))) & outside).astype(np.int8)
    return int(np.cumsum(steps, dtype=idx.dtype).max(initial=0))


def _no_constant(name: str) -> Any:
    raise RequestError(f"body is not valid JSON: {name} is not a JSON number", code="invalid_json")


def parse_json_body(body: bytes, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """An HTTP body as a dict: UTF-8, at most max_depth deep (checked before json.loads, whose recursion a deep
    body would exhaust), no NaN/Infinity, no lone surrogates; else RequestError (code invalid_json)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"body is not valid UTF-8 (byte {e.start})", code="invalid_json") from None
    depth = json_depth(body, stop_above=max_depth)
    if depth > max_depth:
        raise RequestError(f"body is nested {depth} levels deep; the limit is {max_depth}", code="invalid_json")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RequestError:
        raise
    except ValueError as e:   # JSONDecodeError, or an integer too long to convert
        raise RequestError(f"body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(f"body must be a JSON object, got {kind_of(data)}", code="invalid_json")
    check_values(data, max_depth)
    return data

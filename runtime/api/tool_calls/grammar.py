"""The llguidance grammar that makes a model write tool calls, for `tool_choice` required, a named tool or auto.

The grammar for `required` / a named tool starts with the section at once; for `auto` it is lazy: free text until
the format's trigger (`<tool_call>`), then the section is constrained and nothing but EOS may follow it. Each tag
that is one special token of the engine's tokenizer is matched as that token (GrammarSpec.tags): llguidance counts
every added `<...>` token as special, so Qwen's `</tool_call>` is one even where tokenizer.json says otherwise.
"""

from __future__ import annotations

import json
from typing import Any

from mlcc.errors import RequestError
from mlcc.runtime.api.structured import JSON_OPTIONS, GrammarSpec, tag_ref
from mlcc.runtime.api.tool_calls.formats import ToolFormat
from mlcc.runtime.api.tool_calls.tools import Tool, request_tools

_HEAD = '{"name": '


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=True) if s else ""


def _lits(s: str, tags: tuple[str, ...]) -> str:
    """A Lark sequence matching s, each of the tags in it as its tag_ref (a token, where it is a special one)."""
    if not s:
        return ""
    for i, tag in enumerate(tags):
        if tag in s:
            return f" {tag_ref(i)} ".join(_lits(p, tags) for p in s.split(tag)).strip()
    return _lit(s)


def _calls_lark(tools: list[Tool], fmt: ToolFormat) -> str:
    rules = ["name_args: " + " | ".join(f"name_args_{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        schema = dict(t.parameters)
        schema["x-guidance"] = JSON_OPTIONS  # the same whitespace rules as response_format schemas
        head = json.dumps(t.name, ensure_ascii=True) + f', "{fmt.args_key}": '
        rules.append(f"name_args_{i}: {_lit(head)} %json {json.dumps(schema, ensure_ascii=True)} \"}}\"")
    return "\n".join(rules)


def _lark(tools: list[Tool], fmt: ToolFormat, lazy: bool, parallel: bool, special: bool) -> str:
    """special: the trigger is one special token (only TEXT's end differs: a special token never matches TEXT)."""
    trig, tags = fmt.triggers[0], fmt.tags
    more = f"({_lits(fmt.sep + _HEAD, tags)} name_args)*" if parallel else ""
    close = _lits(fmt.close, tags)
    if not lazy:
        body = f"start: {_lits(fmt.open + _HEAD, tags)} name_args {more} {close}"
        if fmt.lead:  # or the untagged calls the parser also reads (the model picks: small Qwens write these)
            body += f" | {_lit(_HEAD)} name_args" + (f" ({_lit(chr(10) + _HEAD)} name_args)*" if parallel else "")
    else:
        head = fmt.open + _HEAD
        assert head.startswith(trig), (fmt.name, head, trig)
        rest = _lits(head[len(trig):], tags)
        if special:
            body = f"start: TEXT | TEXT {_lits(trig, tags)} {rest} name_args {more} {close}"
        else:
            body = (f"start: TEXT | trig {rest} name_args {more} {close}\n"
                    f"trig[lazy]: TEXT {_lit(trig)}")
        body += "\nTEXT: /(.|\\n)*/"
    return "%llguidance {}\n" + body + "\n" + _calls_lark(tools, fmt) + "\n"


def _xml_value_lark(sub: dict) -> str | None:
    """A parameter's value as the template writes it: strings as they are (an enum's choices, a pattern, a length
    range; None: any text), everything else as JSON of its subschema."""
    enum = sub.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) and v for v in enum):
        return "(" + " | ".join(_lit(v) for v in enum) + ")"
    if sub.get("type") != "string":
        return f"%json {json.dumps({**sub, 'x-guidance': JSON_OPTIONS}, ensure_ascii=True)}"
    if isinstance(sub.get("pattern"), str):
        return "/" + sub["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
    lo, hi = sub.get("minLength"), sub.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):
        return f"/(.|\\n){{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}/"
    return None


def _xml_lark(tools: list[Tool], fmt: ToolFormat, lazy: bool, parallel: bool, special: bool) -> str:
    """qwen3_coder: each call `<tool_call>\n<function=NAME>\n` + `<parameter=P>\nVALUE\n</parameter>\n` per
    argument + `</function>\n</tool_call>`, parameters named by the tool's schema: string values free text (up to
    the closing tag), the others JSON of their subschema; in the schema's order, the required ones always."""
    tags = fmt.tags
    rules = ["xfn: " + " | ".join(f"xfn_{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        props = t.parameters.get("properties") or {}
        params = []
        for j, (name, sub) in enumerate(props.items()):
            head, end = _lit(f"<parameter={name}>\n"), _lit("\n</parameter>\n")
            value = _xml_value_lark(sub if isinstance(sub, dict) else {})
            if value is None:  # free text up to the closing tag
                rules.append(f"xp_{i}_{j}: {head} xs_{i}_{j}\nxs_{i}_{j}[lazy]: /(.|\\n)*/ {end}")
            else:
                rules.append(f"xp_{i}_{j}: {head} {value} {end}")
            params.append(f"xp_{i}_{j}" + ("" if name in (t.parameters.get("required") or ()) else "?"))
        body = "".join(f" {p}" for p in params)
        rules.append(f"xfn_{i}: {_lit(t.name + '>' + chr(10))}{body}")
    call = f"{_lits(fmt.open, tags)} xfn {_lits(fmt.close, tags)}"
    calls = f"{call} ({_lit(chr(10))} {call})*" if parallel else call
    if not lazy:
        start = f"start: {calls}"
    else:
        rest = f"{_lits(fmt.open[len(fmt.triggers[0]):], tags)} xfn {_lits(fmt.close, tags)}"
        more = f" ({_lit(chr(10))} {call})*" if parallel else ""
        if special:
            start = f"start: TEXT | TEXT {_lits(fmt.triggers[0], tags)} {rest}{more}"
        else:
            start = f"start: TEXT | trig {rest}{more}\ntrig[lazy]: TEXT {_lit(fmt.triggers[0])}"
        start += "\nTEXT: /(.|\\n)*/"
    return "%llguidance {}\n" + start + "\n" + "\n".join(rules) + "\n"


def tool_grammar(tools: list[dict], tool_choice: Any, parallel_tool_calls: bool | None,
                 fmt: ToolFormat) -> GrammarSpec | None:
    """The grammar for `tool_choice`: None for "none"; calls at once for "required" (one, or several if
    parallel_tool_calls) and for a named function (exactly one call of it); a lazy grammar for "auto" (None too)."""
    parsed = request_tools(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice == "auto":
        lazy = True
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        lazy = False
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError("tool_choice must be 'none', 'auto', 'required' or "
                               "{type: 'function', function: {name}}", param="tool_choice")
        match = [t for t in parsed if t.name == name]
        if not match:
            raise RequestError(f"tool_choice names function '{name}', which is not in tools; add it to tools or "
                               "name one of " + ", ".join(t.name for t in parsed), param="tool_choice")
        parsed, lazy, parallel = match, False, False
    else:
        raise RequestError("tool_choice must be 'none', 'auto', 'required' or {type: 'function', function: {name}}",
                           param="tool_choice")
    trig = fmt.triggers[0]
    special_ok = trig.startswith(("<", "[")) and trig.endswith((">", "]"))
    parts = tuple((t.param, json.dumps(t.parameters, sort_keys=True, ensure_ascii=True)) for t in parsed)
    build = _xml_lark if fmt.name == "qwen3_coder" else _lark
    special_text = build(parsed, fmt, lazy, parallel, special=True) if special_ok and lazy else None
    return GrammarSpec(
        "lark", build(parsed, fmt, lazy, parallel, special=False), param="tools", trigger=trig if special_ok else None,
        special_text=special_text, parts=parts, lazy=lazy, tags=fmt.tags)

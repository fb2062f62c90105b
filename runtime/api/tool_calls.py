"""Tool calls: which syntax a model family writes, a grammar that makes it write calls, and a parser back to
OpenAI's `message.tool_calls` / streamed `delta.tool_calls`.

Formats (the section a model writes, N calls):
- hermes (Qwen2.5/Qwen3, Hermes, and every template that ignores `tools`, since tools_system_prompt teaches it):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` repeated, one block per call;
- llama3_json: `{"name": "f", "parameters": {...}}`, parallel calls joined by `; ` (optionally after
  `<|python_tag|>`);
- mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`;
- json (a template that takes tools in a syntax not recognised here): `[{"name": "f", "arguments": {...}}, ...]`;
- qwen3_coder (Qwen3-Coder, Qwen3.5): `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>`
  per call, read by XmlToolCallParser.

The grammar for `required` / a named tool starts with the section at once; for `auto` it is lazy: free text until
the format's trigger (`<tool_call>`), then the section is constrained and nothing but EOS may follow it. Each tag
that is one special token of the engine's tokenizer is matched as that token (GrammarSpec.tags): llguidance counts
every added `<...>` token as special, so Qwen's `</tool_call>` is one even where tokenizer.json says otherwise.

Small Qwen2.5 models (Qwen2.5-Coder-0.5B puts `<tool_call>` at logprob -23) answer `auto` with the bare object
`{"name": ..., "arguments": ...}`, often in a ```json fence; as llama.cpp does for Hermes, the parser takes that as
a call when it opens the message and names one of the request's tools (ToolFormat.lead).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlcc.errors import RequestError
from mlcc.runtime.api.structured import JSON_OPTIONS, GrammarSpec, tag_ref


@dataclass(frozen=True)
class ToolFormat:
    """open + call + (sep + call)* + close, each call `{"name": <name>, "<args_key>": <arguments>}`.
    triggers: where a section starts in free text (the grammar uses the first); noise: what may stand between
    calls and around a section besides whitespace; tags: the markers that may be single special tokens; lead:
    what starts an untagged call at the very start of a message (the noise around it included)."""

    name: str
    open: str
    sep: str
    close: str
    args_key: str
    triggers: tuple[str, ...]
    noise: tuple[str, ...]
    tags: tuple[str, ...] = ()
    lead: tuple[str, ...] = ()


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", "arguments",
                         ("<tool_call>",), ("<tool_call>", "</tool_call>"), ("<tool_call>", "</tool_call>"),
                         ("```json", "```", "{")),
    "llama3_json": ToolFormat("llama3_json", "", "; ", "", "parameters", ('{"name"', "<|python_tag|>", '{ "name"'),
                              (";", "<|python_tag|>"), ("<|python_tag|>",)),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS][", ", ", "]", "arguments", ("[TOOL_CALLS]",),
                          ("[TOOL_CALLS]", "[", "]", ","), ("[TOOL_CALLS]",)),
    "json": ToolFormat("json", "[", ", ", "]", "arguments", ('[{"name"', '{"name"'), ("[", "]", ",")),
    # Qwen3-Coder (and Qwen3.5+): XML calls, read by XmlToolCallParser; open/sep/close frame one call each
    "qwen3_coder": ToolFormat("qwen3_coder", "<tool_call>\n<function=", "\n</tool_call>\n<tool_call>\n<function=",
                              "</function>\n</tool_call>", "arguments", ("<tool_call>",), ("<tool_call>", "</tool_call>"),
                              ("<tool_call>", "</tool_call>")),
}
_HEAD = '{"name": '


def template_takes_tools(chat_template: str | None) -> bool:
    """The chat template renders `tools` itself (otherwise prepend tools_system_prompt to the system message)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tool_call_format(chat_template: str | None, model_type: str | None = None) -> ToolFormat:
    """The call syntax a model writes, from markers in its chat template, else its model_type."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return FORMATS["qwen3_coder"]
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and template_takes_tools(t)):
        return FORMATS["llama3_json"]
    if template_takes_tools(t):
        return FORMATS["json"]
    mt = (model_type or "").lower()
    if mt == "mistral" and not t:
        return FORMATS["mistral"]
    # templates that ignore tools get tools_system_prompt, which teaches the Hermes tags
    return FORMATS["hermes"]


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    parameters: dict
    param: str


def _tools(tools: list[dict]) -> list[_Tool]:
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools must be a non-empty list of {type: 'function', function: {...}}", param="tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"),
                                                                                                 dict):
            raise RequestError(f"{p} must be {{type: 'function', function: {{name, parameters}}}}", param=p)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise RequestError(f"{p}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_', '.' or '-'",
                               param=f"{p}.function.name")
        if name in seen:
            raise RequestError(f"{p}.function.name '{name}' is given twice; tool names must be unique",
                               param=f"{p}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:  # OpenAI: omitting parameters means a function without parameters
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise RequestError(f"{p}.function.parameters must be a JSON Schema object",
                               param=f"{p}.function.parameters")
        desc = fn.get("description") or ""
        out.append(_Tool(name, desc if isinstance(desc, str) else "", params, f"{p}.function.parameters"))
    return out


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


def _calls_lark(tools: list[_Tool], fmt: ToolFormat) -> str:
    rules = ["name_args: " + " | ".join(f"name_args_{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        schema = dict(t.parameters)
        schema["x-guidance"] = JSON_OPTIONS  # the same whitespace rules as response_format schemas
        head = json.dumps(t.name, ensure_ascii=True) + f', "{fmt.args_key}": '
        rules.append(f"name_args_{i}: {_lit(head)} %json {json.dumps(schema, ensure_ascii=True)} \"}}\"")
    return "\n".join(rules)


def _lark(tools: list[_Tool], fmt: ToolFormat, lazy: bool, parallel: bool, special: bool) -> str:
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


def _xml_lark(tools: list[_Tool], fmt: ToolFormat, lazy: bool, parallel: bool, special: bool) -> str:
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
    parsed = _tools(tools)
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


def tools_system_prompt(tools: list[dict], fmt: ToolFormat) -> str:
    """Tool signatures and how to call them, for a chat template that does not render `tools` itself."""
    sigs = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}}, ensure_ascii=False)
        for t in _tools(tools))
    k = fmt.args_key
    if fmt.name == "hermes":
        how = ("For each function call, return a JSON object with the function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n"
               f'{{"name": <function-name>, "{k}": <args-json-object>}}\n</tool_call>')
    elif fmt.name == "llama3_json":
        how = (f'To call a function, respond with only a JSON object {{"name": <function-name>, "{k}": '
               "<args-json-object>}; separate several calls with '; '.")
    else:
        how = (f"To call functions, respond with {fmt.open}"
               f'{{"name": <function-name>, "{k}": <args-json-object>}}{fmt.close}, one object per call.')
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\n{how}")


# ---------------------------------------------------------------------------------------------------------------
# Parsing the model's text back into calls


@dataclass
class ParsedDelta:
    """One streamed piece: content text, or part of tool call `index` (the first carries id and name)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def as_openai(self) -> dict:
        """The entry of a streamed chunk's `delta.tool_calls` (OpenAI's shape)."""
        d: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            d.update(id=self.id, type="function")
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        d["function"] = fn
        return d


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_TEXT, _BETWEEN, _CALL = 0, 1, 2


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallParser:
    """Streaming parser of a model's message in `fmt`: feed() text deltas as they are decoded, flush() once at
    the end (the last held-back text), then finish() for the whole message. Concatenating the streamed pieces
    gives exactly finish()'s content and calls. `tools` is kept for the names; calls are not filtered by it."""

    fmt: ToolFormat
    tools: list[dict] | None = None
    id_factory: Callable[[], str] = new_call_id
    _calls: list[_Call] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _out: list[ParsedDelta] = field(default_factory=list)
    _buf: str = ""  # text not decided yet (a possible trigger/noise prefix, or the call object so far)
    _state: int = _TEXT
    _ws: str = ""  # whitespace held back in text: dropped if a call follows or precedes it
    _after_call: bool = False
    _raw: str = ""  # section text since the last decided point, given back as content if it is no call after all
    _obj_start: int = 0
    _depth: int = 0
    _in_str: bool = False
    _esc: bool = False
    _header: bool = False
    _args_done: bool = False
    _args_from: int = 0
    _done: bool = False
    _started: bool = False  # past the message's leading whitespace: a lead no longer opens a call
    _bare: bool = False  # the section was opened by a lead: only a whole call of a known tool counts

    @property
    def _names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or () if isinstance(t.get("function"), dict)}

    def feed(self, text: str) -> list[ParsedDelta]:
        self._out = []
        self._buf += text
        self._run(final=False)
        return self._out

    def flush(self) -> list[ParsedDelta]:
        """The pieces held back until the end of the message (call once, after the last feed)."""
        self._out = []
        if not self._done:
            self._run(final=True)
            unread = (self._state == _CALL and not self._header) or (self._state == _BETWEEN and not self._calls)
            if unread:  # cut off before a call could be read: it is text
                self._give_back(self._raw + self._buf)
            elif self._state == _TEXT:
                self._text(self._buf)
            # a call cut off inside its arguments (max_tokens) keeps what was streamed
            if self._ws and not self._calls:
                self._emit_content(self._ws)
            self._buf = self._ws = self._raw = ""
            self._done = True
        return self._out

    def finish(self) -> tuple[str | None, list[dict]]:
        """(content, tool_calls in OpenAI's message shape) for the whole message; content is None when there are
        calls and no other text."""
        if not self._done:
            self.flush()
        content = "".join(self._content)
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in self._calls]
        if calls and not content.strip():
            return None, calls
        return content, calls

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    # -- output helpers -----------------------------------------------------------------------------------------
    def _emit_content(self, s: str) -> None:
        if not s:
            return
        self._content.append(s)
        if self._out and self._out[-1].content is not None:
            self._out[-1].content += s
        else:
            self._out.append(ParsedDelta(content=s))

    def _emit_args(self, s: str) -> None:
        if not s:
            return
        idx = len(self._calls) - 1
        self._calls[idx].arguments += s
        last = self._out[-1] if self._out else None
        if last is not None and last.index == idx and last.arguments is not None:
            last.arguments += s
        else:
            self._out.append(ParsedDelta(index=idx, arguments=s))

    def _start_call(self, name: str, arguments: str) -> None:
        call = _Call(self.id_factory(), name, arguments)
        self._calls.append(call)
        self._out.append(ParsedDelta(index=len(self._calls) - 1, id=call.id, name=name, arguments=arguments))

    def _give_back(self, s: str) -> None:
        """Section text that held no call after all: it is content."""
        self._state, self._raw, self._bare = _TEXT, "", False
        self._text(s, keep_ws=True)

    # -- the state machine --------------------------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        while self._buf:
            before = (self._state, len(self._buf))
            if self._state == _TEXT:
                self._scan_text(final)
            elif self._state == _BETWEEN:
                self._scan_between(final)
            else:
                self._scan_call()
            if (self._state, len(self._buf)) == before:
                break  # waiting for more text

    def _scan_text(self, final: bool) -> None:
        buf = self._buf
        if not self._started and self.fmt.lead and self.tools:
            body = buf.lstrip()
            if not final and (not body or any(len(t) > len(body) and t.startswith(body) for t in self.fmt.lead)):
                return  # maybe (the start of a longer) lead: wait
            if any(body.startswith(t) for t in self.fmt.lead):
                self._buf = body
                self._state, self._raw, self._bare, self._started = _BETWEEN, buf[: len(buf) - len(body)], True, True
                return
        self._started = True
        hits = [(buf.find(t), t) for t in self.fmt.triggers if t in buf]
        if hits:
            at = min(hits)[0]
            self._text(buf[:at])
            # whitespace right before a call is not content (unless the call turns out to be none)
            self._buf = buf[at:]
            self._state, self._raw, self._ws, self._bare = _BETWEEN, self._ws, "", False
            return
        keep = 0 if final else self._partial_len(buf, self.fmt.triggers)
        self._text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]

    def _text(self, s: str, keep_ws: bool = False) -> None:
        """Content, holding trailing whitespace back: whitespace next to a call is dropped."""
        body = s.rstrip()
        if body:
            if self._after_call and not keep_ws:
                body = body.lstrip()
            elif self._ws:
                self._emit_content(self._ws)
            self._ws = ""
            self._emit_content(body)
            self._after_call = False
        self._ws += s[len(body):]

    @staticmethod
    def _partial_len(buf: str, marks: tuple[str, ...]) -> int:
        """Length of the longest suffix of buf that is a proper prefix of one of marks."""
        best = 0
        for m in marks:
            for n in range(min(len(m) - 1, len(buf)), best, -1):
                if buf.endswith(m[:n]):
                    best = n
                    break
        return best

    def _scan_between(self, final: bool) -> None:
        fences = tuple(t for t in self.fmt.lead if t != "{") if self._bare else ()
        buf, noise = self._buf, self.fmt.noise + fences
        i = 0
        while i < len(buf):
            c = buf[i]
            if c.isspace():
                i += 1
                continue
            m = next((n for n in noise if buf.startswith(n, i)), None)
            if m is not None:
                i += len(m)
                continue
            if c == "{":
                self._raw += buf[:i]
                self._buf = buf[i:]
                self._state, self._obj_start = _CALL, len(self._raw)
                self._depth, self._in_str, self._esc = 0, False, False
                self._header = self._args_done = False
                return
            if self._partial_len(buf[i:], noise) == len(buf) - i:
                if not final:
                    break  # maybe the start of a tag: wait
                if self._calls:
                    i = len(buf)  # a tag cut off after the last call
                    break
            # text after (or instead of) a section
            raw = self._raw + buf[:i]
            self._buf = buf[i:]
            if self._calls:
                self._state, self._raw, self._after_call = _TEXT, "", True
            else:
                self._give_back(raw)
            return
        self._raw += buf[:i]
        self._buf = buf[i:]

    def _scan_call(self) -> None:
        buf = self._buf
        args_from = 0 if self._header and not self._args_done else None
        for i, c in enumerate(buf):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
                if self._depth == 2 and c == "{" and not self._header:
                    obj = self._raw[self._obj_start:] + buf[: i + 1]
                    m = _HEADER.match(obj)
                    if m is not None and m.end() == len(obj) - 1 and (
                            not self._bare or json.loads(m.group(1)) in self._names):
                        self._header = True
                        self._start_call(json.loads(m.group(1)), "")
                        args_from = i
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and args_from is not None:
                    self._emit_args(buf[args_from: i + 1])
                    args_from, self._args_done = None, True
                elif self._depth <= 0:
                    if args_from is not None:
                        self._emit_args(buf[args_from:i])
                    raw = self._raw + buf[: i + 1]
                    self._buf = buf[i + 1:]
                    self._end_call(raw, raw[self._obj_start:])
                    return
        if args_from is not None:
            self._emit_args(buf[args_from:])
        self._raw += buf
        self._buf = ""

    def _end_call(self, raw: str, obj: str) -> None:
        self._state, self._raw = _BETWEEN, ""
        self._after_call = True
        if self._header:
            return
        try:
            value = json.loads(obj)
        except json.JSONDecodeError:
            value = None
        name = value.get("name") if isinstance(value, dict) else None
        if self._bare and not (name in self._names and {"arguments", "parameters"} & value.keys()):
            name = None  # an object that opens a message is a call only if it calls one of the tools
        if not isinstance(name, str):  # braces in ordinary text
            self._after_call = False
            self._give_back(raw)
            return
        args = value.get("arguments", value.get("parameters", {}))
        self._start_call(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def tool_call_parser(fmt: ToolFormat, tools: list[dict] | None) -> ToolCallParser | XmlToolCallParser:
    """The streaming parser of a message in `fmt`. Mistral's template refuses call ids other than 9 letters and
    digits when the calls come back as history, so its calls get such ids (as vLLM's mistral parser gives)."""
    if fmt.name == "qwen3_coder":
        return XmlToolCallParser(fmt, tools)
    if fmt.name == "mistral":
        return ToolCallParser(fmt, tools, id_factory=_mistral_call_id)
    return ToolCallParser(fmt, tools)


def _mistral_call_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


# ---------------------------------------------------------------------------------------------------------------
# Qwen3-Coder's XML calls: <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>

_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
_XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_XML_END = re.compile(r"\s*</function>")


def xml_value(text: str, schema: dict | None) -> Any:
    """A parameter's text as the JSON value its schema types it as (as vLLM's qwen3_coder parser converts it):
    strings as written, numbers and booleans read, anything else parsed as JSON where it is JSON."""
    kind = (schema or {}).get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if text.lower() == "null" and kind != "string":
        return None
    if kind == "string":
        return text
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            f = float(text)
            return int(f) if f.is_integer() and "." not in text and "e" not in text.lower() else f
        if kind == "boolean":
            if text.strip().lower() in ("true", "false"):
                return text.strip().lower() == "true"
            return text
        return json.loads(text)
    except ValueError:
        return text


@dataclass
class XmlToolCallParser:
    """ToolCallParser's interface (feed, flush, finish, has_tool_calls) for the qwen3_coder format. A call's
    arguments stream one whole parameter at a time, as the JSON object's next member."""

    fmt: ToolFormat
    tools: list[dict] | None = None
    id_factory: Callable[[], str] = new_call_id
    _calls: list[_Call] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _out: list[ParsedDelta] = field(default_factory=list)
    _buf: str = ""
    _state: int = _TEXT
    _ws: str = ""
    _params: int = 0
    _after_call: bool = False
    _done: bool = False

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def feed(self, text: str) -> list[ParsedDelta]:
        self._out = []
        self._buf += text
        self._run(final=False)
        return self._out

    def flush(self) -> list[ParsedDelta]:
        self._out = []
        if not self._done:
            self._run(final=True)
            if self._state == _BETWEEN:  # a <tool_call> with no function: text
                self._text(self._OPEN + self._buf)
            elif self._state == _TEXT:
                self._text(self._buf)
            if self._ws and not self._calls:
                self._emit_content(self._ws)
            self._buf = self._ws = ""
            self._done = True
        return self._out

    finish = ToolCallParser.finish
    has_tool_calls = ToolCallParser.has_tool_calls
    _emit_content = ToolCallParser._emit_content
    _emit_args = ToolCallParser._emit_args
    _start_call = ToolCallParser._start_call

    def _text(self, s: str) -> None:
        """Content, trailing whitespace held back (dropped before a call), leading whitespace after a call dropped."""
        body = s.rstrip()
        if body:
            if self._after_call:
                body, self._ws, self._after_call = body.lstrip(), "", False
            self._emit_content(self._ws + body)
            self._ws = ""
        self._ws += s[len(body):] if body or not self._after_call else ""

    def _schema(self, name: str) -> dict:
        for t in self.tools or ():
            fn = t.get("function") or {}
            if fn.get("name") == name:
                return (fn.get("parameters") or {}).get("properties") or {}
        return {}

    def _run(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == _TEXT:
                at = buf.find(self._OPEN)
                if at < 0:
                    keep = 0 if final else ToolCallParser._partial_len(buf, (self._OPEN,))
                    self._text(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                self._text(buf[:at])
                self._buf, self._state = buf[at + len(self._OPEN):], _BETWEEN
            elif self._state == _BETWEEN:
                m = _XML_FUNCTION.match(buf)
                if m is None:
                    if not final and (not buf.strip() or "<function=".startswith(buf.strip()[:10])
                                      or (buf.lstrip().startswith("<function=") and ">" not in buf)):
                        return  # the function's tag is still coming
                    self._state, self._buf = _TEXT, ""
                    self._text(self._OPEN + buf)
                    continue
                self._ws = ""
                self._start_call(m.group(1).strip(), "")
                self._buf, self._state, self._params = buf[m.end():], _CALL, 0
            else:
                m = _XML_PARAMETER.match(buf)
                if m is not None:
                    name = m.group(1).strip()
                    value = xml_value(m.group(2), self._schema(self._calls[-1].name).get(name))
                    sep = "{" if self._params == 0 else ", "
                    self._emit_args(sep + json.dumps(name, ensure_ascii=False) + ": "
                                    + json.dumps(value, ensure_ascii=False))
                    self._buf, self._params = buf[m.end():], self._params + 1
                    continue
                m = _XML_END.match(buf)
                if m is not None:
                    rest = buf[m.end():].lstrip()
                    if rest.startswith(self._CLOSE):
                        rest = rest[len(self._CLOSE):]
                    elif not final and self._CLOSE.startswith(rest):
                        return  # maybe </tool_call> is coming
                    self._emit_args("}" if self._params else "{}")
                    self._buf, self._state, self._after_call = rest, _TEXT, True
                    continue
                return  # a parameter or the end is still coming (or the reply was cut off)

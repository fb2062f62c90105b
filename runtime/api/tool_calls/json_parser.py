"""Parsing a model's text in a JSON-call format (hermes, llama3_json, mistral, json) back into OpenAI's
`message.tool_calls` / streamed `delta.tool_calls`.

Small Qwen2.5 models (Qwen2.5-Coder-0.5B puts `<tool_call>` at logprob -23) answer `auto` with the bare object
`{"name": ..., "arguments": ...}`, often in a ```json fence; as llama.cpp does for Hermes, the parser takes that as
a call when it opens the message and names one of the request's tools (ToolFormat.lead).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlcc.runtime.api.tool_calls.formats import ToolFormat


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

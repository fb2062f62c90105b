"""Parsing a model's text in a JSON-call format (hermes, llama3_json, mistral, json) back into OpenAI's
`message.tool_calls` / streamed `delta.tool_calls`.

Small Qwen2.5 models (Qwen2.5-Coder-0.5B puts `<tool_call>` at logprob -23) answer `auto` with the bare object
`{"name": ..., "arguments": ...}`, often in a ```json fence; as llama.cpp does for Hermes, the parser takes that as
a call when it opens the message and names one of the request's tools (ToolFormat.lead).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mlcc.runtime.api.tool_calls.base import _BETWEEN, _CALL, _TEXT, BaseParser

_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


@dataclass
class ToolCallParser(BaseParser):
    """Streaming parser of a model's message in `fmt` (BaseParser's feed, flush, finish). `tools` is kept for
    the names; calls are not filtered by it."""

    _raw: str = ""  # section text since the last decided point, given back as content if it is no call after all
    _obj_start: int = 0
    _depth: int = 0
    _in_str: bool = False
    _esc: bool = False
    _header: bool = False
    _args_done: bool = False
    _args_from: int = 0
    _started: bool = False  # past the message's leading whitespace: a lead no longer opens a call
    _bare: bool = False  # the section was opened by a lead: only a whole call of a known tool counts

    @property
    def _names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or () if isinstance(t.get("function"), dict)}

    def _flush_rest(self) -> None:
        unread = (self._state == _CALL and not self._header) or (self._state == _BETWEEN and not self._calls)
        if unread:  # cut off before a call could be read: it is text
            self._give_back(self._raw + self._buf)
        elif self._state == _TEXT:
            self._text(self._buf)
        # a call cut off inside its arguments (max_tokens) keeps what was streamed
        self._raw = ""

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

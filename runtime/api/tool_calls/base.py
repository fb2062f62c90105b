"""What both tool-call parsers give back (ParsedDelta pieces, the calls) and the stream handling they share."""

from __future__ import annotations

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


_TEXT, _BETWEEN, _CALL = 0, 1, 2


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class BaseParser:
    """feed() text deltas as they are decoded, flush() once at the end (the last held-back text), then finish()
    for the whole message; concatenating the streamed pieces gives exactly finish()'s content and calls. A
    format's parser reads what it can decide of _buf in _run, and what is left of it at the end in _flush_rest."""

    fmt: ToolFormat
    tools: list[dict] | None = None
    id_factory: Callable[[], str] = new_call_id
    _calls: list[_Call] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _out: list[ParsedDelta] = field(default_factory=list)
    _buf: str = ""  # text not decided yet (a possible trigger/noise prefix, or the call so far)
    _state: int = _TEXT
    _ws: str = ""  # whitespace held back in text: dropped if a call follows or precedes it
    _after_call: bool = False
    _done: bool = False

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
            self._flush_rest()
            if self._ws and not self._calls:
                self._emit_content(self._ws)
            self._buf = self._ws = ""
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

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def _flush_rest(self) -> None:
        raise NotImplementedError

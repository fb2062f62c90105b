"""Reasoning models: the `<think>...</think>` part of a reply as `message.reasoning_content` (and `reasoning`, vLLM's
current name; both carry the same text), streamed as `delta.reasoning_content` / `delta.reasoning`. The parsers are
vLLM's `--reasoning-parser` choices:

- deepseek_r1: the chat template may open `<think>` in the prompt (DeepSeek-R1, QwQ), so everything up to
  `</think>` is reasoning, a leading `<think>` the model writes itself dropped; a reply without `</think>` is all
  reasoning (cut off while thinking);
- qwen3: reasoning only where the reply opens with `<think>` (Qwen3 with `enable_thinking: false` writes none, its
  template having closed an empty one in the prompt); a reply cut off inside it is reasoning so far.

Whitespace right after `</think>` is dropped: the content starts at the answer. The content goes on to the tool-call
parser (runtime.api.tool_calls), so calls after the reasoning parse as without it.

openai_gptoss: gpt-oss's harmony messages (runtime.api.tool_calls.harmony), the analysis channel as reasoning.

While a reply is reasoning, a grammar (tool_choice required, response_format) waits: ReasoningGate lets every token
through until `</think>`, then hands over to the grammar's matcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlcc.options import REASONING_PARSERS

START, END = "<think>", "</think>"
_UNDECIDED, _REASONING, _CONTENT = 0, 1, 2


@dataclass
class ReasoningParser:
    """feed() text deltas, flush() once at the end, then finish(). Each returns ("reasoning" | "content", text)
    pieces; their concatenation per kind is finish()'s (reasoning, content)."""

    kind: str
    _state: int = _UNDECIDED
    _buf: str = ""
    _ws: bool = False  # right after </think>: whitespace is dropped
    _ended: bool = False  # a </think> was read (an empty reasoning is still reasoning)
    _reasoning: list[str] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _out: list[tuple[str, str]] = field(default_factory=list)
    _done: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.kind!r}; known: {', '.join(PARSERS)}")

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._out = []
        self._buf += text
        self._run(final=False)
        return self._out

    def flush(self) -> list[tuple[str, str]]:
        self._out = []
        if not self._done:
            self._run(final=True)
            self._emit("reasoning" if self._state == _REASONING else "content", self._buf)
            self._buf, self._done = "", True
        return self._out

    def finish(self) -> tuple[str | None, str]:
        """(reasoning, or None where the reply had none; content)."""
        if not self._done:
            self.flush()
        reasoning = "".join(self._reasoning)
        return (reasoning if reasoning or self._ended else None), "".join(self._content)

    @property
    def in_reasoning(self) -> bool:
        return self._state != _CONTENT

    def _emit(self, kind: str, s: str) -> None:
        if not s:
            return
        (self._reasoning if kind == "reasoning" else self._content).append(s)
        if self._out and self._out[-1][0] == kind:
            self._out[-1] = (kind, self._out[-1][1] + s)
        else:
            self._out.append((kind, s))

    def _run(self, final: bool) -> None:
        if self._state == _UNDECIDED:
            body = self._buf.lstrip()
            if body.startswith(START):
                self._buf, self._state = body[len(START):], _REASONING
            elif not final and START.startswith(body):
                return  # maybe the start of <think>: wait
            else:
                self._state = _REASONING if self.kind == "deepseek_r1" else _CONTENT
        if self._state == _REASONING:
            at = self._buf.find(END)
            if at < 0:
                keep = 0 if final else _partial(self._buf, END)
                self._emit("reasoning", self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            self._emit("reasoning", self._buf[:at])
            self._buf, self._state, self._ws, self._ended = self._buf[at + len(END):], _CONTENT, True, True
        if self._ws:
            body = self._buf.lstrip()
            if not body and not final:
                self._buf = ""
                return
            self._buf, self._ws = body, False
        self._emit("content", self._buf)
        self._buf = ""


def _partial(buf: str, mark: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of mark."""
    for n in range(min(len(mark) - 1, len(buf)), 0, -1):
        if buf.endswith(mark[:n]):
            return n
    return 0


PARSERS = REASONING_PARSERS


def make_parser(kind: str) -> Any:
    """The reasoning parser named `kind` (ReasoningParser's feed, flush, finish)."""
    if kind == "openai_gptoss":
        from mlcc.runtime.api.tool_calls.harmony import HarmonyReasoningParser

        return HarmonyReasoningParser()
    return ReasoningParser(kind)


class ReasoningGate:
    """A grammar matcher (runtime.api.structured.Matcher) that applies once the reasoning is over: every token is
    allowed while the reply thinks, the grammar from the first token after `</think>`. deepseek_r1 starts inside
    the reasoning; qwen3 may open it with `<think>` as its first token, and otherwise the grammar applies at once.
    start_id / end_id: the tokens of `<think>` / `</think>` (the tags must be single tokens of the tokenizer)."""

    __slots__ = ("_end", "_m", "_start", "_state")

    def __init__(self, matcher: Any, kind: str, start_id: int, end_id: int):
        self._m, self._start, self._end = matcher, start_id, end_id
        self._state = _REASONING if kind == "deepseek_r1" else _UNDECIDED

    @property
    def error(self) -> str | None:
        return self._m.error

    def fill_mask(self, out: np.ndarray, row: int) -> None:
        if self._state == _REASONING:
            out[row] = -1
            return
        self._m.fill_mask(out, row)
        if self._state == _UNDECIDED:
            bits = out[row].view(np.uint32)
            bits[self._start >> 5] |= np.uint32(1 << (self._start & 31))

    def accept(self, token_id: int) -> None:
        if self._state == _UNDECIDED:
            self._state = _REASONING if token_id == self._start else _CONTENT
            if self._state == _REASONING:
                return
        if self._state == _REASONING:
            if token_id == self._end:
                self._state = _CONTENT
            return
        self._m.accept(token_id)

    def is_done(self) -> bool:
        return self._state == _CONTENT and self._m.is_done()

    def can_stop(self) -> bool:
        return self._state == _REASONING or self._m.can_stop()

    def forced_text(self) -> bytes:
        return self._m.forced_text() if self._state == _CONTENT else b""

"""OpenAI's harmony format (gpt-oss): a reply is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>

and a tool call is a message addressed to the function, its body the JSON arguments:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>

(the recipient `to=...` may also stand before `<|channel|>`). The `analysis` channel is the model's reasoning, the
`final` channel (and a message without a channel) the answer; `commentary` without a recipient is text the model
shows the user before its calls, so content too.

Two readers share the splitting: HarmonyReasoningParser (vLLM's `openai_gptoss` reasoning parser, chosen by
default for a harmony chat template) gives the analysis text as reasoning and the answer as content, and hands
each call message on as it was written; HarmonyToolParser (the tool-call parser of the `harmony` format) turns
those messages into OpenAI tool calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mlcc.runtime.api.tool_calls.base import BaseParser, ParsedDelta, _Call

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_MARKS = (START, CHANNEL, MESSAGE, *ENDS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEADER, _BODY, _OUTSIDE = 0, 1, 2


def _held(buf: str) -> int:
    """Length of the longest suffix of buf that may be the start of a marker."""
    for n in range(min(max(len(m) for m in _MARKS) - 1, len(buf)), 0, -1):
        if any(m.startswith(buf[-n:]) for m in _MARKS):
            return n
    return 0


@dataclass
class _Reader:
    """Splits harmony text into messages: on_open(header) when a header is complete, on_body(text) for body text
    as it comes, on_close(end marker) at the end of a body; text outside any message goes to on_text. A reply
    starts inside the header of its first message (the prompt ends with `<|start|>assistant`)."""

    _buf: str = ""
    _state: int = _HEADER
    _header: str = ""

    def read(self, text: str, final: bool) -> None:
        self._buf += text
        while self._buf:
            if self._state == _BODY:
                hits = [(self._buf.find(m), m) for m in (*ENDS, START)]
                at, mark = min(((i, m) for i, m in hits if i >= 0), default=(-1, ""))
                if at < 0:
                    keep = 0 if final else _held(self._buf)
                    self.on_body(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self.on_body(self._buf[:at])
                self.on_close(mark if mark != START else "")
                # a message cut short by the next one's <|start|> (models do this) begins that one's header
                self._buf = self._buf[at + len(mark):]
                self._state, self._header = _HEADER, ""
            elif self._state == _HEADER:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if final:  # a header cut off (max_tokens): nothing was said
                        self._buf = ""
                    return
                self._header += self._buf[:at]
                self._buf = self._buf[at + len(MESSAGE):]
                self._state = _BODY
                self.on_open(self._header.replace(START, ""))
            else:
                at = min((i for i in (self._buf.find(START), self._buf.find(CHANNEL)) if i >= 0), default=-1)
                if at < 0:
                    keep = 0 if final else _held(self._buf)
                    self.on_text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self.on_text(self._buf[:at])
                self._buf, self._state, self._header = self._buf[at:], _HEADER, ""

    def on_open(self, header: str) -> None: ...

    def on_body(self, text: str) -> None: ...

    def on_close(self, end: str) -> None:
        self._state = _OUTSIDE if end else _HEADER

    def on_text(self, text: str) -> None: ...


def channel_of(header: str) -> str:
    """The channel a header names ("" for none): the word after <|channel|>."""
    if CHANNEL not in header:
        return ""
    rest = header.split(CHANNEL, 1)[1].strip()
    return rest.split()[0] if rest else ""


def recipient_of(header: str) -> str | None:
    m = _RECIPIENT.search(header)
    return m[1] if m else None


@dataclass
class HarmonyReasoningParser(_Reader):
    """ReasoningParser's contract (feed, flush, finish, in_reasoning) for harmony replies: analysis bodies as
    reasoning, call messages as written (for HarmonyToolParser), every other body as content."""

    kind: str = "openai_gptoss"
    _channel: str = ""
    _call: bool = False
    _ended: bool = False
    _reasoning: list[str] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _out: list[tuple[str, str]] = field(default_factory=list)
    _done: bool = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._out = []
        self.read(text, final=False)
        return self._out

    def flush(self) -> list[tuple[str, str]]:
        self._out = []
        if not self._done:
            self.read("", final=True)
            self._done = True
        return self._out

    def finish(self) -> tuple[str | None, str]:
        if not self._done:
            self.flush()
        reasoning = "".join(self._reasoning)
        return (reasoning if reasoning or self._ended else None), "".join(self._content)

    @property
    def in_reasoning(self) -> bool:
        return self._state != _BODY or self._channel == "analysis"

    def _emit(self, kind: str, s: str) -> None:
        if not s:
            return
        (self._reasoning if kind == "reasoning" else self._content).append(s)
        if self._out and self._out[-1][0] == kind:
            self._out[-1] = (kind, self._out[-1][1] + s)
        else:
            self._out.append((kind, s))

    def on_open(self, header: str) -> None:
        self._channel, self._call = channel_of(header), recipient_of(header) is not None
        if self._call:
            role = "" if header.lstrip().startswith("assistant") else "assistant"
            self._emit("content", f"{START}{role}{header}{MESSAGE}")

    def on_body(self, text: str) -> None:
        if self._call:
            self._emit("content", text)
        elif self._channel == "analysis":
            self._emit("reasoning", text)
        else:
            self._emit("content", text)

    def on_close(self, end: str) -> None:
        if self._call:
            self._emit("content", end or "<|call|>")
        if self._channel == "analysis":
            self._ended = True
        self._channel, self._call = "", False
        super().on_close(end)

    def on_text(self, text: str) -> None:
        self._emit("content", text)


@dataclass
class HarmonyToolParser(BaseParser):
    """The tool-call parser of the harmony format (BaseParser's feed, flush, finish): each message addressed to
    `functions.NAME` is a call of NAME with its body as the arguments; the bodies of the others are content.
    It reads what HarmonyReasoningParser passes on: content, and the call messages as written."""

    _reader: _Reader | None = None
    _call_open: bool = False

    def __post_init__(self) -> None:
        parser = self

        class Reader(_Reader):
            def on_open(self, header: str) -> None:
                to = recipient_of(header)
                parser._call_open = to is not None
                if to is not None:
                    name = to.removeprefix("functions.")
                    parser._calls.append(_Call(parser.id_factory(), name))
                    parser._announce()

            def on_body(self, text: str) -> None:
                if parser._call_open:
                    parser._emit_args(text)
                else:
                    parser._emit_content(text)

            def on_close(self, end: str) -> None:
                parser._call_open = False
                super().on_close(end)

            def on_text(self, text: str) -> None:
                parser._emit_content(text)

        # what reaches it is the reasoning parser's output: content, and the call messages whole
        self._reader = Reader(_state=_OUTSIDE)

    def _announce(self) -> None:
        idx = len(self._calls) - 1
        call = self._calls[idx]
        self._out.append(ParsedDelta(index=idx, id=call.id, name=call.name, arguments=""))

    def _run(self, final: bool) -> None:
        text, self._buf = self._buf, ""
        self._reader.read(text, final)

    def _flush_rest(self) -> None:
        pass

"""Parsing Qwen3-Coder's XML calls back into OpenAI's tool calls:
<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mlcc.runtime.api.tool_calls.base import _BETWEEN, _CALL, _TEXT, BaseParser

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
class XmlToolCallParser(BaseParser):
    """The parser of the qwen3_coder format (BaseParser's feed, flush, finish). A call's
    arguments stream one whole parameter at a time, as the JSON object's next member."""

    _params: int = 0

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def _flush_rest(self) -> None:
        if self._state == _BETWEEN:  # a <tool_call> with no function: text
            self._text(self._OPEN + self._buf)
        elif self._state == _TEXT:
            self._text(self._buf)

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
                    keep = 0 if final else self._partial_len(buf, (self._OPEN,))
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

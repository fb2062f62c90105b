"""Which parser reads a format's messages."""

from __future__ import annotations

import secrets
import string

from mlcc.runtime.api.tool_calls.formats import ToolFormat
from mlcc.runtime.api.tool_calls.harmony import HarmonyToolParser
from mlcc.runtime.api.tool_calls.json_parser import ToolCallParser
from mlcc.runtime.api.tool_calls.xml_parser import XmlToolCallParser


def tool_call_parser(fmt: ToolFormat, tools: list[dict] | None
                     ) -> ToolCallParser | XmlToolCallParser | HarmonyToolParser:
    """The streaming parser of a message in `fmt`. Mistral's template refuses call ids other than 9 letters and
    digits when the calls come back as history, so its calls get such ids (as vLLM's mistral parser gives)."""
    if fmt.name == "harmony":
        return HarmonyToolParser(fmt, tools)
    if fmt.name == "qwen3_coder":
        return XmlToolCallParser(fmt, tools)
    if fmt.name == "mistral":
        return ToolCallParser(fmt, tools, id_factory=_mistral_call_id)
    return ToolCallParser(fmt, tools)


def _mistral_call_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))

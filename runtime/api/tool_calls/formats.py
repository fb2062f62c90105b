"""Which syntax a model family writes its tool calls in (the section a model writes, N calls):

- hermes (Qwen2.5/Qwen3, Hermes, and every template that ignores `tools`, since tools_system_prompt teaches it):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` repeated, one block per call;
- llama3_json: `{"name": "f", "parameters": {...}}`, parallel calls joined by `; ` (optionally after
  `<|python_tag|>`);
- mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`;
- json (a template that takes tools in a syntax not recognised here): `[{"name": "f", "arguments": {...}}, ...]`;
- qwen3_coder (Qwen3-Coder, Qwen3.5): `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>`
  per call, read by XmlToolCallParser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
# gpt-oss: harmony messages addressed to=functions.NAME (read by tool_calls.harmony; no grammar writes them yet)
HARMONY = ToolFormat("harmony", "", "", "", "arguments", ("<|start|>assistant<|channel|>commentary to=",), (),
                     ("<|start|>", "<|channel|>", "<|message|>", "<|call|>"))


def template_takes_tools(chat_template: str | None) -> bool:
    """The chat template renders `tools` itself (otherwise prepend tools_system_prompt to the system message)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tool_call_format(chat_template: str | None, model_type: str | None = None) -> ToolFormat:
    """The call syntax a model writes, from markers in its chat template, else its model_type."""
    t = chat_template or ""
    if "<|channel|>" in t:
        return HARMONY
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

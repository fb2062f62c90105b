"""Tool calls: which syntax a model family writes (formats), the request's tools checked and taught in a system
prompt (tools), a grammar that makes the model write calls (grammar), and parsers back to OpenAI's
`message.tool_calls` / streamed `delta.tool_calls` (base, json_parser, xml_parser; parsers picks one per format)."""

from mlcc.runtime.api.tool_calls.base import ParsedDelta, new_call_id
from mlcc.runtime.api.tool_calls.formats import FORMATS, ToolFormat, template_takes_tools, tool_call_format
from mlcc.runtime.api.tool_calls.grammar import tool_grammar
from mlcc.runtime.api.tool_calls.json_parser import ToolCallParser
from mlcc.runtime.api.tool_calls.parsers import tool_call_parser
from mlcc.runtime.api.tool_calls.tools import tools_system_prompt
from mlcc.runtime.api.tool_calls.xml_parser import XmlToolCallParser, xml_value

__all__ = [
    "FORMATS",
    "ParsedDelta",
    "ToolCallParser",
    "ToolFormat",
    "XmlToolCallParser",
    "new_call_id",
    "template_takes_tools",
    "tool_call_format",
    "tool_call_parser",
    "tool_grammar",
    "tools_system_prompt",
    "xml_value",
]

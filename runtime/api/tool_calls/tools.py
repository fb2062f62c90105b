"""The request's `tools`, checked, and written into a system prompt for a chat template that does not render them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mlcc.errors import RequestError
from mlcc.runtime.api.tool_calls.formats import ToolFormat


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    param: str


def request_tools(tools: list[dict]) -> list[Tool]:
    """The request's `tools`, each checked; a RequestError names the first field that is wrong."""
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
        out.append(Tool(name, desc if isinstance(desc, str) else "", params, f"{p}.function.parameters"))
    return out


def tools_system_prompt(tools: list[dict], fmt: ToolFormat) -> str:
    """Tool signatures and how to call them, for a chat template that does not render `tools` itself."""
    sigs = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}}, ensure_ascii=False)
        for t in request_tools(tools))
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

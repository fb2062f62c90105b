"""The chat request's JSON schema as the web engine imports it (web/js/request_schema.js, committed): pydantic's
schema of runtime/api/protocol.py's ChatCompletionRequest (the one source of truth) with its `$ref`s inlined,
titles/defaults/descriptions dropped and the discriminator reduced to the tag's name. mlcc.web does not import the
runtime (the layers contract), so the command `mlcc export-request-schema` (mlcc.cli, above both) renders the file
from protocol through render_js and writes it; tests/test_web_requests.py checks the committed copy is current."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JS_FILE = Path(__file__).parent / "js" / "request_schema.js"
_DROP = {"title", "default", "description"}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    out = {}
    for k, v in node.items():
        if k in _DROP and not isinstance(v, dict):
            continue
        if k == "discriminator":
            out[k] = v["propertyName"]   # the oneOf member is the one whose const matches the tag
        elif k == "properties":
            out[k] = {name: _inline(s, defs) for name, s in v.items()}
        else:
            out[k] = _inline(v, defs)
    return out


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """pydantic's model_json_schema() without $defs: every $ref replaced by its definition."""
    return _inline({k: v for k, v in schema.items() if k != "$defs"}, schema.get("$defs", {}))


def render_js(schema: dict[str, Any], unsupported: dict[str, str], max_depth: int) -> str:
    """request_schema.js: the inlined schema, the fields refused by name with their hints, the nesting limit."""
    return ("// Generated from mlcc.runtime.api.protocol by `mlcc export-request-schema`; do not edit.\n"
            f"export const CHAT_REQUEST_SCHEMA = {json.dumps(inline_refs(schema), sort_keys=True)};\n"
            f"export const UNSUPPORTED_FIELDS = {json.dumps(unsupported, sort_keys=True)};\n"
            f"export const MAX_DEPTH = {max_depth};\n")

"""The OpenAI request protocol: pydantic models that are both the validation and the OpenAPI document.

`parse_chat_request` / `parse_completion_request` are the one place a request is checked (the Python API and the
HTTP server both go through them); `parse_json_body` turns an HTTP body into a dict without recursion. Every
refusal is a `RequestError` whose param is the field as OpenAI names it ("messages[0].role") and whose code is
OpenAI's (invalid_type, invalid_value, unknown_parameter, ...). The engine checks what needs the model: token
ids against the vocabulary, the context window, whether a grammar compiles.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlcc.errors import RequestError
from mlcc.runtime.api.json_body import MAX_DEPTH, check_values, kind_of, param_path, parse_json_body

__all__ = ["MAX_DEPTH", "ChatCompletionRequest", "CompletionRequest", "parse_chat_request", "parse_completion_request",
           "parse_json_body"]

MAX_TOOLS = 128
MAX_LOGIT_BIAS = 1024
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Model(BaseModel):
    # strict: "10" is not an integer and 1 is not a boolean, as in OpenAI's API; NaN and inf are not numbers
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


# -- messages ------------------------------------------------------------------------------------------------------

class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageUrl(_Model):
    url: str = Field(description="a data: URL (data:image/png;base64,...) or an https URL of an allowed domain")
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(_Model):
    type: Literal["image_url"]
    image_url: ImageUrl


Content = str | list[TextPart]
UserContent = str | list[Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]]


class _Message(_Model):
    name: str | None = None
    _part_types: ClassVar[tuple[str, ...]] = ("text",)

    @field_validator("content", mode="before", check_fields=False)
    @classmethod
    def _known_parts_only(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and kind not in cls._part_types:
                raise ValueError("image_url parts are taken in user messages only")
            if isinstance(kind, str) and kind not in cls._part_types:
                raise ValueError(f"content part type '{kind}' is not supported; send text parts "
                                 "({\"type\": \"text\", \"text\": ...}) or a string (image_url parts in user "
                                 "messages)")
        return v


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: UserContent
    _part_types: ClassVar[tuple[str, ...]] = ("text", "image_url")


class FunctionCall(_Model):
    name: str
    arguments: str = Field(description="the call's arguments as a JSON string")


class ToolCall(_Model):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
                    Field(discriminator="role")]


# -- tools, response formats, structured outputs ---------------------------------------------------------------------

class FunctionDefinition(_Model):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema for the arguments (an object)")
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: ToolChoiceFunction


class ResponseFormatText(_Model):
    type: Literal["text"]


class ResponseFormatJsonObject(_Model):
    type: Literal["json_object"]


class JsonSchemaFormat(_Model):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatJsonSchema(_Model):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]


class StructuredOutputs(_Model):
    """vLLM's constraint (extra_body): exactly one of the keys."""
    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="Lark, or GBNF (detected by '::=')")


class StreamOptions(_Model):
    include_usage: bool | None = None


# -- requests ------------------------------------------------------------------------------------------------------

class _Request(_Model):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=16)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> bias in [-100, 100]")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0: off")
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=256)
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or not all(stops):
            raise ValueError("expected a non-empty string or a list of at most 4 non-empty strings")
        return stops

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        return 0 if v == -1 else v   # one spelling of "off" for the sampler

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: Any) -> Any:
        if isinstance(v, dict):   # the Python API may key by int, as tokenizers return them
            v = {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: b for k, b in v.items()}
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10 and int(k) <= INT32_MAX):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got '{k[:40]}'")
            if not -100 <= b <= 100:
                raise ValueError(f"values must be in [-100, 100], got {b} for token {k}")
        return v

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias keyed by int token id (the engine checks them against the vocabulary)."""
        return {int(k): b for k, b in (self.logit_bias or {}).items()}


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="deprecated for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='more variables for the chat template, e.g. {"enable_thinking": false} (vLLM\'s)')
    # accepted where the value asks for nothing this server lacks
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens (None: up to the context window)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="a string or a list of token ids (a batch of one of either is accepted too)")
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX, description="default 16; 0 with echo=true scores the prompt")
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=16)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, str) or not v or isinstance(v[0], int):
            return v
        if len(v) != 1:
            raise ValueError(f"a batch of {len(v)} prompts is not supported: send one prompt per request "
                             "(use n for several samples of one prompt)")
        return v[0]


# -- parsing -------------------------------------------------------------------------------------------------------

_UNSUPPORTED = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "metadata": "requests are not stored",
    "audio": "this server generates text only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "this server has no reasoning-effort control",
    "verbosity": "this server has no verbosity control",
    "web_search_options": "this server has no web search",
    "min_tokens": "use ignore_eos with max_tokens",
    "guided_json": "use structured_outputs: {\"json\": ...}",
    "guided_regex": "use structured_outputs: {\"regex\": ...}",
    "guided_choice": "use structured_outputs: {\"choice\": ...}",
    "guided_grammar": "use structured_outputs: {\"grammar\": ...}",
}


def parse_chat_request(kw: dict[str, Any]) -> ChatCompletionRequest:
    """A chat completions request (the HTTP body, or create()'s keyword arguments) validated, or RequestError."""
    req = _validate(ChatCompletionRequest, kw)
    _check_common(req)
    _check_messages(req.messages)
    _check_tools(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if req.structured_outputs is not None and req.response_format is not None \
            and req.response_format.type != "text":
        raise RequestError("response_format and structured_outputs both constrain the output: send one of them",
                           param="structured_outputs", code="invalid_value")
    return req


def parse_completion_request(kw: dict[str, Any]) -> CompletionRequest:
    req = _validate(CompletionRequest, kw)
    _check_common(req)
    if req.suffix:
        raise RequestError("suffix (insertion) is not supported", param="suffix", code="unsupported_parameter")
    if req.best_of is not None and req.best_of not in (1, req.n or 1):
        raise RequestError("best_of other than n is not supported: every sample is returned", param="best_of",
                           code="unsupported_value")
    if req.max_tokens == 0 and not req.echo:
        raise RequestError("max_tokens 0 only makes sense with echo: true (to score the prompt)", param="max_tokens",
                           code="invalid_value")
    if isinstance(req.prompt, list) and not req.prompt:
        raise RequestError("the prompt is empty", param="prompt", code="invalid_value")
    return req


# -- LoRA adapters loaded and unloaded at run time (vLLM's endpoints and bodies) -----------------------------------

class LoadLoraAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False   # replace an adapter of that name


class UnloadLoraAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None   # (vLLM's; the name is what selects the adapter here)


def parse_load_lora_request(kw: Any) -> LoadLoraAdapterRequest:
    return _validate(LoadLoraAdapterRequest, kw)


def parse_unload_lora_request(kw: Any) -> UnloadLoraAdapterRequest:
    return _validate(UnloadLoraAdapterRequest, kw)


def _validate(model: type[_Model], kw: Any) -> Any:
    if not isinstance(kw, dict):
        raise RequestError(f"the request must be a JSON object, got {kind_of(kw)}", code="invalid_type")
    check_values(kw)
    for k in kw:
        if k in _UNSUPPORTED:
            raise RequestError(f"'{k}' is not supported by this server: {_UNSUPPORTED[k]}", param=k,
                               code="unsupported_parameter")
    try:
        return model.model_validate(kw)
    except ValidationError as e:
        raise _request_error(e, kw) from None


def _check_common(req: _Request) -> None:
    # a caller that leaves stream out (the engine, which takes it as its own argument) is not refused for it
    if req.stream_options is not None and not req.stream and "stream" in req.model_fields_set:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options",
                           code="invalid_value")
    so = req.structured_outputs
    if so is not None and len(so.model_fields_set) != 1:
        raise RequestError("structured_outputs takes exactly one of json, regex, choice, grammar", code="invalid_value",
                           param="structured_outputs")


def _check_messages(messages: list[Any]) -> None:
    open_calls: set[str] = set()   # the ids of the last assistant message's tool calls
    for i, m in enumerate(messages):
        if m.role == "assistant":
            if m.content is None and not m.tool_calls:
                raise RequestError(f"messages[{i}] (assistant) needs content or tool_calls", code="invalid_value",
                                   param=f"messages[{i}].content")
            open_calls = {c.id for c in m.tool_calls or ()}
        elif m.role == "tool":
            if not open_calls:
                raise RequestError(f"messages[{i}]: a message with role 'tool' must answer a preceding assistant "
                                   "message with 'tool_calls'", param=f"messages[{i}].role", code="invalid_value")
            if m.tool_call_id not in open_calls:
                raise RequestError(f"messages[{i}].tool_call_id '{m.tool_call_id[:64]}' is none of the preceding "
                                   "assistant message's tool call ids", param=f"messages[{i}].tool_call_id",
                                   code="invalid_value")
        else:
            open_calls = set()


def _check_tools(req: ChatCompletionRequest) -> None:
    tools, choice = req.tools or [], req.tool_choice
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise RequestError(f"tools[{i}]: a second tool named '{name}'", param=f"tools[{i}].function.name",
                               code="invalid_value")
        params = tools[i].function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise RequestError("a tool's parameters must be a JSON schema of type 'object'",
                               param=f"tools[{i}].function.parameters", code="invalid_value")
    if not tools and choice not in (None, "none"):
        raise RequestError("tool_choice is only allowed when tools are specified", param="tool_choice",
                           code="invalid_value")
    if not tools and req.parallel_tool_calls is not None:
        raise RequestError("parallel_tool_calls is only allowed when tools are specified",
                           param="parallel_tool_calls", code="invalid_value")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(f"tool_choice names '{choice.function.name[:64]}', which is not in tools",
                           param="tool_choice.function.name", code="invalid_value")
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    constrained = req.structured_outputs is not None or (req.response_format is not None
                                                         and req.response_format.type != "text")
    if tools and forced and constrained:
        raise RequestError("a forced tool call (tool_choice required or named) cannot also follow response_format"
                           " / structured_outputs", param="tool_choice", code="invalid_value")


# -- pydantic's errors in OpenAI's words -----------------------------------------------------------------------------

def _show(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, int):
        return str(v) if abs(v) < 10**30 else "a very large integer"
    if isinstance(v, str):
        return repr(v[:60] + ("..." if len(v) > 60 else ""))
    if isinstance(v, float):
        return repr(v)
    return kind_of(v)


def _data_path(loc: tuple[Any, ...], data: Any, missing: bool) -> tuple[Any, ...]:
    """pydantic's loc without its union-member tags ('str', 'list[TextPart]', 'user'): walk the input alongside and
    keep only the keys and indices that are really there (and a missing field's name at the end)."""
    path: list[Any] = []
    for j, p in enumerate(loc):
        if (isinstance(data, dict) and p in data) or (isinstance(data, (list, tuple)) and isinstance(p, int)
                                                       and p < len(data)):
            path.append(p)
            data = data[p]
        elif missing and isinstance(data, dict) and j == len(loc) - 1 and isinstance(p, str):
            path.append(p)
    return tuple(path)


_TYPE_NAMES = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
               "list_type": "an array", "dict_type": "an object", "model_type": "an object", "none_required": "null",
               "model_attributes_type": "an object", "int_from_float": "an integer", "string_sub_type": "a string"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}


def _request_error(e: ValidationError, data: Any) -> RequestError:
    errors = [(err, _data_path(err["loc"], data, err["type"] == "missing")) for err in e.errors(include_url=False)]
    # a union reports each member: keep the member that got furthest (the deepest path) for the first field
    top = errors[0][1][:1]
    same = [(err, p) for err, p in errors if p[:1] == top]
    deepest = max(len(p) for _, p in same)
    err, path = next((err, p) for err, p in same if len(p) == deepest)
    param, kind, v = param_path(path), err["type"], err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "missing":
        return RequestError(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return RequestError(f"Unknown parameter: '{param}'.", param=param, code="unknown_parameter")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        field = ctx.get("discriminator", "").strip("'")
        param = param_path((*path, field))
        tag = v.get(field) if isinstance(v, dict) else None
        if kind == "union_tag_not_found":
            return RequestError(f"Missing required parameter: '{param}'.", param=param,
                                code="missing_required_parameter")
        if not isinstance(tag, str):
            return RequestError(f"Invalid type for '{param}': expected a string, but got {kind_of(tag)} instead.",
                                param=param, code="invalid_type")
        return RequestError(f"Invalid value: {_show(tag)}. Supported values are: {ctx.get('expected_tags')}.",
                            param=param, code="invalid_value")
    if kind in _TYPE_NAMES:
        wanted = sorted({_TYPE_NAMES[x["type"]] for x, p in same if p == path and x["type"] in _TYPE_NAMES})
        expected = wanted[0] if len(wanted) == 1 else "one of " + " or ".join(wanted)
        return RequestError(f"Invalid type for '{param}': expected {expected}, but got {kind_of(v)} instead.",
                            param=param, code="invalid_type")
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        number = "integer" if isinstance(v, int) else "decimal"
        low = op.startswith(">")
        return RequestError(f"Invalid '{param}': {number} {'below minimum' if low else 'above maximum'} value. "
                            f"Expected a value {op} {ctx.get(key)}, but got {_show(v)} instead.", param=param,
                            code=f"{number}_{'below_min' if low else 'above_max'}_value")
    if kind == "literal_error":
        return RequestError(f"Invalid value: {_show(v)}. Supported values are: {ctx.get('expected')}.", param=param,
                            code="invalid_value")
    if kind in ("too_long", "too_short"):
        long = kind == "too_long"
        limit = ctx.get("max_length") if long else ctx.get("min_length")
        code = "empty_array" if not long and limit == 1 else f"array_{'above_max' if long else 'below_min'}_length"
        want = f"at most {limit} items" if long else "a non-empty array" if limit == 1 else f"at least {limit} items"
        return RequestError(f"Invalid '{param}': expected {want}, but got {ctx.get('actual_length')}.", param=param,
                            code=code)
    if kind == "string_pattern_mismatch":
        return RequestError(f"Invalid '{param}': string does not match pattern. Expected a string that matches the "
                            f"pattern '{ctx.get('pattern')}'.", param=param, code="invalid_value")
    if kind == "finite_number":
        return RequestError(f"Invalid '{param}': expected a finite number, but got {_show(v)}.", param=param,
                            code="invalid_value")
    if kind == "value_error" and isinstance(ctx.get("error"), Exception):
        return RequestError(f"Invalid '{param}': {ctx['error']}", param=param, code="invalid_value")
    return RequestError(f"Invalid '{param}': {err['msg']}.", param=param, code="invalid_value")

"""From a validated request (runtime.api.protocol) to a runtime.api.call.Call: the prompt's ids (chat template, tools),
sampling parameters, the limits of the context window and the KV cache, logit_bias, logprobs, and the grammar
that constrains the output (response_format, structured_outputs, or the tools for tool_choice required/named)."""

from __future__ import annotations

import json
from typing import Any

from mlcc.errors import ContextWindowExceededError, RequestError
from mlcc.runtime.api import reasoning, structured, tool_calls
from mlcc.runtime.api.call import Call, CallSpec
from mlcc.runtime.api.images import ImageLimits, load_images, place_images
from mlcc.runtime.core.logit_processing import TOP_LOGPROBS
from mlcc.runtime.core.sampler import SamplingParams

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "seed", "stop", "stop_token_ids", "ignore_eos")


def chat_call(engine: Any, fields: dict[str, Any]) -> Call:
    """fields: a ChatCompletionRequest as a dict (model_dump(exclude_none=True))."""
    tools = fields.get("tools") or []
    choice = fields.get("tool_choice", "auto" if tools else "none")
    calling = bool(tools) and choice != "none"
    fmt = engine.tool_format if tools else None
    takes_tools = tool_calls.template_takes_tools(engine.tokenizer.chat_template)
    urls = _image_urls(fields["messages"])
    vision = engine.vision if urls else None
    if urls and vision is None:
        raise RequestError("this model takes no images (it has no vision encoder); send text only",
                           param=urls[0][1])
    pixels = load_images(urls, vision, ImageLimits.of(engine.config)) if urls else []
    image_parts = _template_renders_images(engine.tokenizer.chat_template)
    messages = [_template_message(m, None if takes_tools else engine.tool_format,
                                  vision["placeholder"] if vision else None, image_parts and bool(urls))
                for m in fields["messages"]]
    if tools and not takes_tools:
        messages = _with_tools_prompt(messages, tool_calls.tools_system_prompt(tools, fmt))
        template_tools = None
    else:
        template_tools = list(tools) or None
    kwargs = fields.get("chat_template_kwargs")
    images = ()
    if urls:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=template_tools,
                                                    template_kwargs=kwargs)
        ids = engine.tokenizer.encode(_expand_images(text, vision, len(urls)))
        images = place_images(ids, pixels, vision)
    elif kwargs:
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=template_tools, template_kwargs=kwargs))
    else:
        ids = engine.encode_chat(messages, tools=template_tools)
    spec = _grammar_spec(fields)
    harmony = engine.tool_format.name == "harmony"
    if harmony and (spec is not None or (calling and choice != "auto")):
        raise RequestError("this model writes harmony messages (gpt-oss), which response_format, structured_outputs "
                           "and tool_choice other than 'auto' or 'none' cannot constrain yet: drop them",
                           param="tool_choice" if spec is None else "response_format")
    if calling and not harmony and (choice != "auto" or fmt is not None):
        if spec is not None:
            raise RequestError("tools with tool_choice other than 'none' cannot be combined with response_format or "
                               "structured_outputs: drop one of them", param="tool_choice")
        spec = tool_calls.tool_grammar(tools, choice, fields.get("parallel_tool_calls", True), fmt)
    top = fields.get("top_logprobs", 0) if fields.get("logprobs") else None
    max_tokens = fields.get("max_completion_tokens", fields.get("max_tokens"))
    kind = getattr(engine.config, "reasoning_parser", None)
    if harmony:  # gpt-oss: its reply is always harmony messages
        kind = "openai_gptoss"
    return _make(engine, True, fields, ids, max_tokens, spec, top, None,
                 make_parser=(lambda: tool_calls.tool_call_parser(fmt, tools)) if calling else None,
                 make_reasoner=(lambda: reasoning.make_parser(kind)) if kind else None, reasoning_kind=kind,
                 images=images)


def completion_call(engine: Any, fields: dict[str, Any]) -> Call:
    """fields: a CompletionRequest as a dict (model_dump(exclude_none=True))."""
    prompt = fields["prompt"]
    ids = engine.encode_prompt(prompt)
    echo = bool(fields.get("echo"))
    top = fields.get("logprobs")
    if echo and top is not None and fields.get("stream"):
        raise RequestError("echo with logprobs is answered whole, not streamed: set stream=false", param="echo")
    prefix = "" if not echo else prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)
    return _make(engine, False, fields, ids, fields.get("max_tokens", 16), _grammar_spec(fields), top,
                 top if echo else None, prefix=prefix, prefix_ids=ids if echo else [])


def _make(engine: Any, chat: bool, fields: dict[str, Any], ids: list[int], max_tokens: int | None,
          spec: Any, top: int | None, prompt_top: int | None, reasoning_kind: str | None = None, **kw: Any) -> Call:
    params = SamplingParams.from_request(max_tokens=max_tokens or None, **{k: fields.get(k) for k in _SAMPLING_FIELDS})
    max_new = _max_new(engine, ids, max_tokens)
    bad = [t for t in fields.get("stop_token_ids") or [] if t >= engine.model.vocab]
    if bad:
        raise RequestError(f"stop_token_ids: {bad[0]} is not in this model's vocabulary [0, {engine.model.vocab})",
                           param="stop_token_ids")
    if top is not None and top > TOP_LOGPROBS:
        raise RequestError(f"at most {TOP_LOGPROBS} top logprobs are supported", param="top_logprobs")
    logit_bias = _logit_bias(engine, fields.get("logit_bias"))
    for needed, name, param in ((spec is not None, "apply_bitmask", spec.param if spec else ""),
                                (logit_bias, "apply_logit_bias", "logit_bias"),
                                (top is not None, "logprobs", "logprobs")):
        if needed:
            engine.model.require_logit_function(name, param)
    grammar = engine.grammars.compile(spec) if spec is not None else None
    make_matcher = (lambda: engine.grammars.matcher(grammar)) if grammar is not None else None
    if make_matcher is not None and reasoning_kind:
        tags = [engine.grammars.special_token_id(t) for t in (reasoning.START, reasoning.END)]
        if None not in tags:  # the grammar waits for the reasoning to end
            plain = make_matcher
            make_matcher = lambda: reasoning.ReasoningGate(plain(), reasoning_kind, *tags)
    stream_options = fields.get("stream_options") or {}
    return Call(engine, CallSpec(
        chat, ids, params, max_new, n=fields.get("n", 1), model=fields.get("model") or engine.model_name,
        lora=engine.adapter_for(fields.get("model")),
        include_usage=bool(stream_options.get("include_usage")), logit_bias=logit_bias, top_logprobs=top,
        prompt_top_logprobs=prompt_top,
        make_matcher=make_matcher, **kw))


def _max_new(engine: Any, ids: list[int], max_tokens: int | None) -> int:
    n, window = len(ids), engine.context_window
    if n == 0:
        raise RequestError("the prompt is empty", param="prompt")
    if n >= window:
        raise ContextWindowExceededError(f"this model's maximum context length is {window} tokens; the prompt has "
                                         f"{n}. Shorten the prompt or the conversation.")
    room = window - n
    if max_tokens is not None and max_tokens > room:
        raise ContextWindowExceededError(
            f"this model's maximum context length is {window} tokens; the prompt has {n} and max_tokens is "
            f"{max_tokens}. Lower max_tokens to at most {room}.")
    max_new = min(max_tokens if max_tokens is not None else room, engine.kv_cache_tokens - n)
    engine.core.check_fits(n, max_new)
    return max_new


def _logit_bias(engine: Any, bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {int(k): float(v) for k, v in bias.items()}
    bad = [k for k in out if not 0 <= k < engine.model.vocab]
    if bad:
        raise RequestError(f"logit_bias token id {bad[0]} is not in this model's vocabulary [0, {engine.model.vocab})",
                           param="logit_bias")
    return out


def _grammar_spec(fields: dict[str, Any]) -> Any:
    rf, so = fields.get("response_format"), fields.get("structured_outputs")
    if rf is not None and rf.get("type") != "text" and so is not None:
        raise RequestError("give either response_format or structured_outputs, not both", param="structured_outputs")
    if so is not None:
        return structured.spec_from_structured_outputs(so)
    return structured.spec_from_response_format(rf)


def _image_urls(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(url, the part's parameter path) of every image_url part, in prompt order."""
    return [(part["image_url"]["url"], f"messages[{i}].content[{j}].image_url")
            for i, m in enumerate(messages) if isinstance(m.get("content"), list)
            for j, part in enumerate(m["content"]) if part["type"] == "image_url"]


def _template_renders_images(template: str | None) -> bool:
    """Whether a chat template writes image parts itself (HF's {"type": "image"} items, as Gemma 3's does); other
    templates get the image placeholder inside the text."""
    return bool(template) and ("'image'" in template or '"image"' in template)


def _expand_images(text: str, vision: dict[str, Any], count: int) -> str:
    """The rendered prompt with each image's placeholder replaced by its whole token sequence, as the model's
    processor does before tokenizing."""
    placeholder = vision["placeholder"]
    found = text.count(placeholder)
    if found != count:
        raise RequestError(f"the chat template wrote {found} image placeholders ({placeholder}) for {count} images; "
                           f"do not write {placeholder} as text", param="messages")
    return text.replace(placeholder, vision["expanded"])


def _template_message(m: dict[str, Any], calls_as_text: Any = None, image_placeholder: str | None = None,
                      image_parts: bool = False) -> dict[str, Any]:
    """OpenAI's message → what HF chat templates read: content parts joined into one string, tool-call arguments
    as objects (templates render them with tojson). calls_as_text: for a template that ignores tools, the
    runtime.api.tool_calls.ToolFormat an assistant's earlier calls are written into its content with, as the model
    was told to write them. In a request with images, a template that renders image parts (image_parts) gets
    every message as parts (images as {"type": "image"} items); any other template gets image_placeholder in the
    text where each image is."""
    m = dict(m)
    content = m.get("content")
    if image_parts and image_placeholder is not None and m["role"] in ("system", "user", "assistant") and \
            isinstance(content, (str, list)):
        # a template that renders image parts may read only parts (llava-hf's selects them by type): every message
        # of a request with images goes as parts
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        m["content"] = [{"type": "image"} if part["type"] == "image_url" else part for part in parts]
    elif isinstance(content, list) and any(part["type"] == "image_url" for part in content):
        m["content"] = "".join(part["text"] if part["type"] == "text" else image_placeholder for part in content)
    elif isinstance(content, list):
        m["content"] = "".join(part["text"] for part in content)
    if m.get("tool_calls") and calls_as_text is not None:
        fmt = calls_as_text
        written = fmt.sep.join(json.dumps({"name": c["function"]["name"], fmt.args_key: _arguments(c)},
                                          ensure_ascii=False) for c in m.pop("tool_calls"))
        m["content"] = f"{m.get('content') or ''}{fmt.open}{written}{fmt.close}"
        return m
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = dict(c["function"])
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except (json.JSONDecodeError, TypeError):
                pass   # a template that prints arguments as given still gets the string
            calls.append({**c, "function": fn})
        m["tool_calls"] = calls
    return m


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return call["function"]["arguments"]


def _with_tools_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """For a template that never renders `tools`: the tools' description leads the system message."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{prompt}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]

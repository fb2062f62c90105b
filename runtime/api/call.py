"""One create() call: a validated request (runtime.api.protocol) becomes the n Requests the engine core runs, and their
events become the `openai` package's response objects (whole or streamed), logprobs and tool calls included."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Callable

import numpy as np
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_message_function_tool_call import Function as ToolFunction
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from openai.types.completion_usage import PromptTokensDetails

from mlcc.runtime.core.logit_processing import TokenLogprob
from mlcc.runtime.core.request import Event, Request
from mlcc.runtime.core.sampler import SamplingParams


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """What one create() call asks for, as runtime.api.prepare checked it. ids: the prompt's token ids; max_new: the
    most tokens a choice may add; n: choices; model: the name responses carry; make_matcher: a new grammar matcher
    per choice, or None; make_parser: a new tool-call parser per choice (runtime.api.tool_calls), or None;
    make_reasoner: a new reasoning parser per choice (runtime.api.reasoning), ahead of the tool-call parser, or None;
    prefix / prefix_ids: echo's prompt text and ids, before each choice's."""

    chat: bool
    ids: list[int]
    params: SamplingParams
    max_new: int
    n: int = 1
    model: str = ""
    include_usage: bool = False
    logit_bias: dict[int, float] | None = None
    top_logprobs: int | None = None
    prompt_top_logprobs: int | None = None
    make_matcher: Callable[[], Any] | None = None
    make_parser: Callable[[], Any] | None = None
    make_reasoner: Callable[[], Any] | None = None
    prefix: str = ""
    prefix_ids: list[int] = dataclasses.field(default_factory=list)
    lora: Any = None   # the LoRA adapter the `model` field names (runtime.device.lora.LoraAdapter), or None
    images: tuple = ()   # the prompt's images (runtime.core.request.PromptImage)


class Call:
    """Submits the n choices of a CallSpec to an engine (runtime.engine.Engine) and shapes their events."""

    def __init__(self, engine: Any, spec: CallSpec):
        self.engine, self.spec = engine, spec
        self.chat, self.ids, self.params, self.max_new, self.n = spec.chat, spec.ids, spec.params, spec.max_new, spec.n
        self.rid = f"{'chatcmpl' if spec.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.name, self.include_usage = int(time.time()), spec.model, spec.include_usage
        self.top_logprobs = spec.top_logprobs
        self.parsers = [spec.make_parser() for _ in range(spec.n)] if spec.make_parser else None
        self.reasoners = [spec.make_reasoner() for _ in range(spec.n)] if spec.make_reasoner else None
        self.texts, self.reasons, self.completion_tokens = [spec.prefix] * spec.n, ["stop"] * spec.n, 0
        self.cached_tokens = 0   # prompt tokens the prefix cache served (runtime.core.prefix_cache)
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(spec.n)]
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._tool_calls_seen = [False] * spec.n

    def submit(self, sink: Callable[[int, Event], None]) -> list[Request]:
        """The n choices as one request and its forks: the prompt is read once. Choice i draws from a generator
        seeded seed + i, so it equals a lone request with that seed."""
        engine, reqs = self.engine, []
        for i in range(self.n):
            seed = None if self.params.seed is None else (self.params.seed + i) % (1 << 64)  # any int64 is valid
            # a tool-call or reasoning parser reads the tags, which some tokenizers make special tokens
            decoder = engine.tokenizer.stream(skip_special_tokens=self.parsers is None and self.reasoners is None)
            reqs.append(Request(self.ids, self.params, self.max_new, lambda e, i=i: sink(i, e),
                                decoder, engine.tokenizer.eos_ids, rng=np.random.default_rng(seed),
                                logit_bias=self.spec.logit_bias, top_logprobs=self.top_logprobs,
                                prompt_top_logprobs=self.spec.prompt_top_logprobs, lora=self.spec.lora,
                                images=self.spec.images,
                                matcher=self.spec.make_matcher() if self.spec.make_matcher else None))
        reqs[0].forks = reqs[1:]
        engine.core.submit(reqs[0])
        return reqs

    def usage(self) -> CompletionUsage:
        return CompletionUsage(prompt_tokens=len(self.ids), completion_tokens=self.completion_tokens,
                               total_tokens=len(self.ids) + self.completion_tokens,
                               prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    def _finish_reason(self, i: int, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self._tool_calls_seen[i] else reason

    # -- non-streaming -----------------------------------------------------------------------------------------
    def collect(self, i: int, ev: Event) -> None:
        if ev.kind == "delta":
            self.texts[i] += ev.text
            if ev.logprob is not None:
                self.logprobs[i].append(ev.logprob)
        elif ev.kind == "finish":
            self.reasons[i] = ev.finish_reason
            self.completion_tokens += ev.completion_tokens
            self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
            if ev.prompt_logprobs is not None:
                self.prompt_logprobs = [None, *ev.prompt_logprobs]

    def result(self) -> ChatCompletion | Completion:
        if self.chat:
            choices = []
            for i in range(self.n):
                content, calls, reasoning = self.texts[i], None, {}
                if self.reasoners is not None:
                    self.reasoners[i].feed(content)
                    thought, content = self.reasoners[i].finish()
                    if thought is not None:
                        reasoning = {"reasoning_content": thought, "reasoning": thought}
                if self.parsers is not None:
                    self.parsers[i].feed(content)
                    content, parsed = self.parsers[i].finish()
                    calls = [_message_tool_call(c) for c in parsed] or None
                    self._tool_calls_seen[i] = bool(calls)
                # reasoning: extra fields (vLLM's), which the openai types keep
                message = ChatCompletionMessage(role="assistant", content=content, tool_calls=calls, **reasoning)
                logprobs = (ChoiceLogprobs(content=[self._chat_logprob(t) for t in self.logprobs[i]])
                            if self.top_logprobs is not None else None)
                choices.append(ChatChoice(index=i, finish_reason=self._finish_reason(i, self.reasons[i]),
                                          message=message, logprobs=logprobs))
            return ChatCompletion(id=self.rid, created=self.created, model=self.name, object="chat.completion",
                                  usage=self.usage(), choices=choices)
        return Completion(id=self.rid, created=self.created, model=self.name, object="text_completion",
                          usage=self.usage(),
                          choices=[CompletionChoice(index=i, text=self.texts[i], finish_reason=self.reasons[i],
                                                    logprobs=self._completion_logprobs(i))
                                   for i in range(self.n)])

    # -- logprobs ----------------------------------------------------------------------------------------------
    def _chat_logprob(self, t: TokenLogprob) -> ChatCompletionTokenLogprob:
        token, raw = self.engine.token_text(t.token_id)
        top = []
        for tid, lp in t.top:
            s, b = self.engine.token_text(tid)
            top.append(TopLogprob(token=s, bytes=b, logprob=lp))
        return ChatCompletionTokenLogprob(token=token, bytes=raw, logprob=t.logprob, top_logprobs=top)

    def _completion_logprobs(self, i: int, entries: list | None = None,
                             offset: int = 0) -> CompletionLogprobs | None:
        """OpenAI's legacy shape: parallel lists; with echo the prompt's tokens come first (the first one without
        a logprob). offset: where the first entry's text starts in the choice's text."""
        if self.top_logprobs is None:
            return None
        if entries is None:
            entries = list(self.logprobs[i])
            if self.prompt_logprobs is not None:
                prompt = [None if j == 0 else self.prompt_logprobs[j] for j in range(len(self.spec.prefix_ids))]
                entries = list(zip(self.spec.prefix_ids, prompt)) + [(t.token_id, t) for t in entries]
            else:
                entries = [(t.token_id, t) for t in entries]
        tokens, values, tops, offsets = [], [], [], []
        for tid, t in entries:
            s, _ = self.engine.token_text(tid)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            values.append(None if t is None else t.logprob)
            tops.append(None if t is None else {self.engine.token_text(a)[0]: lp for a, lp in t.top})
        # model_construct: the API's first echoed token has null logprobs, which the openai type does not admit
        return CompletionLogprobs.model_construct(tokens=tokens, token_logprobs=values, top_logprobs=tops,
                                                  text_offset=offsets)

    # -- streaming ---------------------------------------------------------------------------------------------
    def _chat_chunk(self, i: int | None, delta: ChoiceDelta | None = None, finish: str | None = None,
                    logprobs: list[TokenLogprob] | None = None) -> ChatCompletionChunk:
        choices = [] if i is None else [ChunkChoice(
            index=i, finish_reason=finish, delta=delta or ChoiceDelta(),
            logprobs=None if logprobs is None else ChunkLogprobs(content=[self._chat_logprob(t) for t in logprobs]))]
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.name, object="chat.completion.chunk",
                                   choices=choices, usage=self.usage() if i is None else None)

    def _completion_chunk(self, i: int | None, text: str = "", finish: str | None = None,
                          logprobs: CompletionLogprobs | None = None) -> Completion:
        # the API streams finish_reason=null until the end; the openai type only admits the final values
        choices = [] if i is None else [CompletionChoice.model_construct(index=i, text=text, finish_reason=finish,
                                                                          logprobs=logprobs)]
        return Completion(id=self.rid, created=self.created, model=self.name, object="text_completion",
                          choices=choices, usage=self.usage() if i is None else None)

    def stream_start(self) -> list[Any]:
        if self.chat:
            return [self._chat_chunk(i, ChoiceDelta(role="assistant", content="")) for i in range(self.n)]
        if not self.spec.prefix:
            return []
        return [self._completion_chunk(i, self.spec.prefix) for i in range(self.n)]

    def stream_event(self, i: int, ev: Event) -> list[Any]:
        if ev.kind == "delta":
            lps = [ev.logprob] if ev.logprob is not None else None
            if not self.chat:
                if not ev.text and lps is None:
                    return []
                lp = (self._completion_logprobs(i, [(ev.logprob.token_id, ev.logprob)], len(self.texts[i]))
                      if lps else None)
                self.texts[i] += ev.text
                return [self._completion_chunk(i, ev.text, logprobs=lp)]
            if self.parsers is None and self.reasoners is None:
                return [self._chat_chunk(i, ChoiceDelta(content=ev.text), logprobs=lps)] if ev.text or lps else []
            out = self._reasoned_chunks(i, ev.text, final=False)
            if lps and out:
                out[-1].choices[0].logprobs = ChunkLogprobs(content=[self._chat_logprob(t) for t in lps])
            return out
        if ev.kind == "finish":
            self.completion_tokens += ev.completion_tokens
            self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
            parsed = self.chat and (self.parsers is not None or self.reasoners is not None)
            out = self._reasoned_chunks(i, "", final=True) if parsed else []
            reason = self._finish_reason(i, ev.finish_reason)
            out.append(self._chat_chunk(i, finish=reason) if self.chat else self._completion_chunk(i, finish=reason))
            return out
        return []

    def _reasoned_chunks(self, i: int, text: str, final: bool) -> list[ChatCompletionChunk]:
        """A text delta through the reasoning parser (reasoning deltas) and then the tool-call parser."""
        if self.reasoners is None:
            pieces = [("content", text)]
        else:
            r = self.reasoners[i]
            pieces = r.feed(text) + (r.flush() if final else [])
        out = []
        for kind, s in pieces:
            if kind == "reasoning":
                out.append(self._chat_chunk(i, ChoiceDelta(reasoning_content=s, reasoning=s)))
            elif self.parsers is None:
                out.append(self._chat_chunk(i, ChoiceDelta(content=s)))
            else:
                out += self._parsed_chunks(i, self.parsers[i].feed(s))
        if final and self.parsers is not None:
            out += self._parsed_chunks(i, self.parsers[i].flush())
        return out

    def _parsed_chunks(self, i: int, pieces: list) -> list[ChatCompletionChunk]:
        """Tool-call parser pieces (runtime.api.tool_calls.ParsedDelta) as chunks: content, or tool-call deltas."""
        out = []
        for d in pieces:
            if d.index is not None:
                self._tool_calls_seen[i] = True
                out.append(self._chat_chunk(i, ChoiceDelta(tool_calls=[_delta_tool_call(d.as_openai())])))
            elif d.content:
                out.append(self._chat_chunk(i, ChoiceDelta(content=d.content)))
        return out

    def stream_end(self) -> list[Any]:
        if not self.include_usage:
            return []
        return [self._chat_chunk(None) if self.chat else self._completion_chunk(None)]


def _message_tool_call(call: dict[str, Any]) -> ChatCompletionMessageFunctionToolCall:
    return ChatCompletionMessageFunctionToolCall(id=call["id"], type="function", function=ToolFunction(
        name=call["function"]["name"], arguments=call["function"]["arguments"]))


def _delta_tool_call(d: dict[str, Any]) -> ChoiceDeltaToolCall:
    fn = d.get("function") or {}
    return ChoiceDeltaToolCall(index=d["index"], id=d.get("id"), type=d.get("type"),
                               function=ChoiceDeltaToolCallFunction(name=fn.get("name"),
                                                                    arguments=fn.get("arguments")))

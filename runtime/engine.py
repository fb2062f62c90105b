"""Engine: the OpenAI-shaped Python API over a compiled model (`engine.chat.completions.create(...)`).

Results are the `openai` package's own types. Sync and async engines share one scheduler thread, so concurrent
callers are batched together.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import numpy as np
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from mlcc import artifact
from mlcc.errors import ContextWindowExceededError, RequestError
from mlcc.options import CompileOptions

from .core import EngineCore
from .request import Event, Request
from .sampler import Sampler, SamplingParams

log = logging.getLogger(__name__)

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "seed", "stop", "ignore_eos")


def _kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    m = cfg["model_config"]
    itemsize = 2 if cfg["model_dtype"] == "float16" else 4
    return 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * itemsize


class Engine:
    """`Engine(model)` where model is an artifacts folder, an HF folder or a .gguf (compiled on first use), or
    None for the bundled SmolLM2-135M-Instruct.

    options: the compile options a model compiled on first use is built with (part of its cache key); for an
    artifacts folder, the options it must have been built with (a mismatch is refused). None: the defaults, or
    whatever the folder was built with. policy: "no_evict" (admit only what can finish) or "max_util" (admit
    eagerly, preempt and recompute). pipeline: decode a lone request pipelined (runtime.core.EngineCore)."""

    def __init__(self, model: str | Path | None = None, target: str = "auto", quant: str | None = None, *,
                 max_batch: int = 4, context_window: int | None = None, kv_cache_tokens: int | None = None,
                 prefill_chunk: int = 512, device_id: int = 0, policy: str = "no_evict",
                 tensor_parallel: int | None = None, options: CompileOptions | None = None,
                 pipeline: bool | None = None):
        from mlcc.targets import detect_local

        from .jit import resolve_model
        from .model import LoadedModel
        from .tokenizer import Tokenizer

        if target == "auto":
            target = detect_local()
        self.model_dir = resolve_model(model, target, quant, tensor_parallel or 1, options)
        built_tp = int(artifact.read_config(self.model_dir).get("tensor_parallel", 1))
        if tensor_parallel is not None and tensor_parallel != built_tp:
            raise artifact.ArtifactError(
                f"{self.model_dir} was compiled for --tensor-parallel {built_tp}, not {tensor_parallel}; recompile "
                f"with `mlcc compile SOURCE --target {target} --tensor-parallel {tensor_parallel} --output DIR`")
        if built_tp > 1:
            from .tensor_parallel import TensorParallelModel

            self.model = TensorParallelModel(self.model_dir)
        else:
            self.model = LoadedModel(self.model_dir, device_id=device_id)
        cfg = self.model.config
        self.model_name = Path(cfg["source"]["path"]).stem if "source" in cfg else self.model_dir.name
        self.tokenizer = Tokenizer(self.model_dir, cfg["tokenizer"])
        self.context_window = min(context_window or self.model.context_window, self.model.context_window)
        if kv_cache_tokens is None:
            kv_cache_tokens = self._default_kv_tokens(max_batch)
        kv_cache_tokens = max(kv_cache_tokens, 64)
        self.kv_cache_tokens = kv_cache_tokens
        self.core = EngineCore(self.model, Sampler.for_model(self.model), max_batch, kv_cache_tokens,
                               min(prefill_chunk, kv_cache_tokens), policy=policy, pipeline=pipeline)
        self.chat = _Chat(self)
        self.completions = _Completions(self)
        log.info("engine ready: %s on %s, KV cache %d tokens (%.0f MB), batch %d", self.model_name,
                 cfg["target"], kv_cache_tokens, kv_cache_tokens * _kv_bytes_per_token(cfg) / 1e6, max_batch)

    def _default_kv_tokens(self, max_batch: int) -> int:
        """Enough for max_batch full contexts, capped by a memory budget (CPU: 1/4 of free RAM, at most 2 GiB)."""
        per_token = _kv_bytes_per_token(self.model.config)
        if self.model.device_kind == "cpu":
            import psutil

            budget = min(psutil.virtual_memory().available // 4, 2 << 30)
        else:
            weights = sum(int(np.prod(p["shape"])) * np.dtype(p["dtype"]).itemsize for p in self.model.config["params"])
            budget = int(self.model.dev.total_global_memory * 0.85) - weights - (1 << 30)
        return int(min(self.context_window * max_batch, max(budget // per_token, 256)))

    # -- request plumbing ----------------------------------------------------------------------------------------
    def _prepare(self, prompt_ids: list[int], max_tokens: int | None, kw: dict[str, Any]) -> tuple[SamplingParams, int]:
        params = SamplingParams.from_request(max_tokens=max_tokens, **{k: kw.get(k) for k in _SAMPLING_FIELDS})
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        if n >= self.context_window:
            raise ContextWindowExceededError(
                f"this model's maximum context length is {self.context_window} tokens; the prompt has {n}. "
                "Shorten the prompt or the conversation.")
        room = self.context_window - n
        if max_tokens is not None and max_tokens > room:
            raise ContextWindowExceededError(
                f"this model's maximum context length is {self.context_window} tokens; the prompt has {n} and "
                f"max_tokens is {max_tokens}. Lower max_tokens to at most {room}.")
        max_new = max_tokens if max_tokens is not None else room
        max_new = min(max_new, self.kv_cache_tokens - n)
        self.core.check_fits(n, max_new)
        return params, max_new

    def run_sync(self, call: "_Call") -> Iterator[tuple[int, Event]]:
        """(choice index, event) as they happen; closing the iterator aborts what is still running."""
        q: queue.Queue[tuple[int, Event]] = queue.Queue()
        reqs = call.submit(self, lambda i, e: q.put((i, e)))
        pending = call.n
        try:
            while pending:
                i, ev = q.get()
                pending -= _finished(ev)
                yield i, ev
        finally:
            self.abort(reqs)

    async def run_async(self, call: "_Call") -> AsyncIterator[tuple[int, Event]]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        reqs = call.submit(self, lambda i, e: loop.call_soon_threadsafe(q.put_nowait, (i, e)))
        pending = call.n
        try:
            while pending:
                i, ev = await q.get()
                pending -= _finished(ev)
                yield i, ev
        finally:
            self.abort(reqs)

    def abort(self, reqs: list[Request]) -> None:
        for r in reqs:
            if r.finish_reason is None:
                self.core.abort(r)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt: text (after the BOS token where the tokenizer wants one) or token ids as given."""
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            if any(t < 0 or t >= self.model.vocab for t in prompt):
                raise RequestError(f"prompt token ids must be in [0, {self.model.vocab})", param="prompt")
            return list(prompt)
        raise RequestError("prompt must be a string or a list of token ids", param="prompt")

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _finished(ev: Event) -> bool:
    """Whether this event ends its sample; a failed step surfaces here as an exception to the caller."""
    if ev.kind == "error":
        raise RuntimeError(f"generation failed: {ev.error}") from ev.error
    return ev.kind == "finish"


def _check_n(n: int | None) -> int:
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
        raise RequestError(f"n must be an integer in [1, 16], got {n!r}", param="n")
    return n


_IGNORED = {"user", "logit_bias", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
            "parallel_tool_calls", "metadata", "store", "service_tier", "suffix", "best_of"}


def _reject_unknown(kw: dict[str, Any]) -> None:
    for k in list(kw):
        if k in _SAMPLING_FIELDS:
            continue
        if k in _IGNORED:
            kw.pop(k)
            continue
        raise RequestError(f"unknown request field '{k}'", param=k)


class _Call:
    """One validated create() call: submits its n samples and shapes events into openai objects."""

    def __init__(self, engine: Engine, chat: bool, ids: list[int], max_tokens: int | None, n: int | None,
                 model: str | None, stream_options: dict[str, Any] | None, kw: dict[str, Any], prefix: str = ""):
        _reject_unknown(kw)
        self.chat, self.ids, self.n = chat, ids, _check_n(n)
        self.params, self.max_new = engine._prepare(ids, max_tokens, kw)
        self.rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.name = int(time.time()), model or engine.model_name
        self.include_usage = bool((stream_options or {}).get("include_usage"))
        self.prefix = prefix   # echo: the prompt's text before each choice's
        self.texts, self.reasons, self.completion_tokens = [prefix] * self.n, ["stop"] * self.n, 0

    def submit(self, engine: Engine, sink) -> list[Request]:
        """The n choices as one request and its forks: the prompt is read once. Choice i draws from a generator
        seeded seed + i, so it equals a lone request with that seed."""
        reqs = []
        for i in range(self.n):
            seed = None if self.params.seed is None else (self.params.seed + i) % (1 << 64)  # any int64 is valid
            reqs.append(Request(self.ids, self.params, self.max_new, lambda e, i=i: sink(i, e),
                                engine.tokenizer.stream(), engine.tokenizer.eos_ids, rng=np.random.default_rng(seed)))
        reqs[0].forks = reqs[1:]
        engine.core.submit(reqs[0])
        return reqs

    def usage(self) -> CompletionUsage:
        return CompletionUsage(prompt_tokens=len(self.ids), completion_tokens=self.completion_tokens,
                               total_tokens=len(self.ids) + self.completion_tokens)

    # -- non-streaming -----------------------------------------------------------------------------------------
    def collect(self, i: int, ev: Event) -> None:
        if ev.kind == "delta":
            self.texts[i] += ev.text
        elif ev.kind == "finish":
            self.reasons[i] = ev.finish_reason
            self.completion_tokens += ev.completion_tokens

    def result(self) -> ChatCompletion | Completion:
        if self.chat:
            return ChatCompletion(
                id=self.rid, created=self.created, model=self.name, object="chat.completion", usage=self.usage(),
                choices=[ChatChoice(index=i, finish_reason=self.reasons[i],
                                    message=ChatCompletionMessage(role="assistant", content=self.texts[i]))
                         for i in range(self.n)])
        return Completion(id=self.rid, created=self.created, model=self.name, object="text_completion",
                          usage=self.usage(),
                          choices=[CompletionChoice(index=i, text=self.texts[i], finish_reason=self.reasons[i])
                                   for i in range(self.n)])

    # -- streaming ---------------------------------------------------------------------------------------------
    def _chunk(self, i: int | None, text: str | None, finish: str | None = None, role: bool = False):
        if self.chat:
            choices = [] if i is None else [ChunkChoice(index=i, finish_reason=finish, delta=ChoiceDelta(
                content=text, role="assistant" if role else None))]
            return ChatCompletionChunk(id=self.rid, created=self.created, model=self.name,
                                       object="chat.completion.chunk", choices=choices,
                                       usage=self.usage() if i is None else None)
        # the API streams finish_reason=null until the end; the openai type only admits the final values
        choices = [] if i is None else [CompletionChoice.model_construct(index=i, text=text or "",
                                                                          finish_reason=finish, logprobs=None)]
        return Completion(id=self.rid, created=self.created, model=self.name, object="text_completion",
                          choices=choices, usage=self.usage() if i is None else None)

    def stream_start(self) -> list[Any]:
        if self.chat:
            return [self._chunk(i, "", role=True) for i in range(self.n)]
        return [self._chunk(i, self.prefix) for i in range(self.n)] if self.prefix else []

    def stream_event(self, i: int, ev: Event) -> list[Any]:
        if ev.kind == "delta" and ev.text:
            return [self._chunk(i, ev.text)]
        if ev.kind == "finish":
            self.completion_tokens += ev.completion_tokens
            return [self._chunk(i, None if self.chat else "", finish=ev.finish_reason)]
        return []

    def stream_end(self) -> list[Any]:
        return [self._chunk(None, None)] if self.include_usage else []


def _sync_stream(engine: Engine, call: _Call) -> Iterator[Any]:
    yield from call.stream_start()
    for i, ev in engine.run_sync(call):
        yield from call.stream_event(i, ev)
    yield from call.stream_end()


async def _async_stream(engine: Engine, call: _Call) -> AsyncIterator[Any]:
    for c in call.stream_start():
        yield c
    async for i, ev in engine.run_async(call):
        for c in call.stream_event(i, ev):
            yield c
    for c in call.stream_end():
        yield c


class _Chat:
    def __init__(self, engine: Engine):
        self.completions = _ChatCompletions(engine)


class _CreateAPI:
    """create() for both endpoints; subclasses say how a request becomes a _Call."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def make_call(self, **kw: Any) -> _Call:
        raise NotImplementedError

    def create(self, *, stream: bool = False, **kw: Any):
        call = self.make_call(**kw)
        if stream:
            return _sync_stream(self.engine, call)
        for i, ev in self.engine.run_sync(call):
            call.collect(i, ev)
        return call.result()


class _ChatCompletions(_CreateAPI):
    """engine.chat.completions: create(messages=..., stream=...) → ChatCompletion | Iterator[ChatCompletionChunk]"""

    def make_call(self, messages: list[dict[str, Any]], model: str | None = None, max_tokens: int | None = None,
                  max_completion_tokens: int | None = None, n: int | None = None,
                  stream_options: dict[str, Any] | None = None, **kw: Any) -> _Call:
        ids = self.engine.encode_chat(messages)
        return _Call(self.engine, True, ids, max_completion_tokens or max_tokens, n, model, stream_options, kw)


class _Completions(_CreateAPI):
    """engine.completions: create(prompt=..., stream=...) → Completion | Iterator[Completion]"""

    def make_call(self, prompt: str | list[int], model: str | None = None, max_tokens: int | None = 16,
                  n: int | None = None, echo: bool = False, stream_options: dict[str, Any] | None = None,
                  **kw: Any) -> _Call:
        ids = self.engine.encode_prompt(prompt)
        prefix = "" if not echo else prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)
        return _Call(self.engine, False, ids, max_tokens, n, model, stream_options, kw, prefix=prefix)


# -- asyncio -----------------------------------------------------------------------------------------------------

class AsyncEngine:
    """Same surface as Engine with `await`; streams are async iterators. Shares the engine's scheduler thread,
    so concurrent coroutines are batched together."""

    def __init__(self, *args: Any, **kw: Any):
        self.engine = args[0] if args and isinstance(args[0], Engine) else Engine(*args, **kw)
        self.chat = _Chat.__new__(_Chat)
        self.chat.completions = _AsyncCreate(self.engine, self.engine.chat.completions)
        self.completions = _AsyncCreate(self.engine, self.engine.completions)

    def shutdown(self) -> None:
        self.engine.shutdown()


class _AsyncCreate:
    def __init__(self, engine: Engine, sync_api: _ChatCompletions | _Completions):
        self.engine, self.sync_api = engine, sync_api

    async def create(self, *, stream: bool = False, **kw: Any):
        call = self.sync_api.make_call(**kw)   # validation errors raise here, at the await
        if stream:
            return _async_stream(self.engine, call)
        async for i, ev in self.engine.run_async(call):
            call.collect(i, ev)
        return call.result()

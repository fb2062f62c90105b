"""Engine: the OpenAI-shaped Python API over a compiled model (`engine.chat.completions.create(...)`).

Results are the `openai` package's own types. Sync and async engines share one scheduler thread, so concurrent
callers are batched together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
from pathlib import Path
from typing import Any, AsyncIterator, Iterator


from mlcc import artifact, hub, kv_cache_format
from mlcc.errors import EngineConfigError, LoraAdapterError, RequestError, SpeculativeConfigError
from mlcc.options import EngineConfig
from mlcc.runtime.api import prepare, protocol, structured, tool_calls
from mlcc.runtime.api.call import Call
from mlcc.runtime.core.request import Event, Request
from mlcc.runtime.core.sampler import Sampler
from mlcc.runtime.device.lora import LoraAdapter, adapter_rank, read_adapter
from mlcc.runtime.engine_core import EngineCore, GenerationError
from mlcc.runtime.spec.spec_config import parse_speculative_config
from mlcc.runtime.spec.speculative import Speculator

log = logging.getLogger(__name__)

def _kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    m = cfg["model_config"]
    kv_dtype = artifact.built_options(cfg).kv_cache_dtype
    return kv_cache_format.bytes_per_token(kv_dtype, cfg["model_dtype"], m["num_hidden_layers"],
                                           m["num_key_value_heads"], m["head_dim"])


class Engine:
    """`Engine(model)` where model is an artifacts folder, an HF folder or a .gguf (compiled on first use), or
    None for the bundled SmolLM2-135M-Instruct.

    The settings are one `EngineConfig` (mlcc.options: what each means and its default), given whole as
    `config=`, as keyword arguments (`Engine(model, max_batch=8, prefix_cache=False)`), or both (the keywords
    override the config's). `target` and `quant` may also come second and third, positionally. The engine keeps
    the resolved config (KV-cache size, context window and prefill chunk as used) in `engine.config`."""

    def __init__(self, model: str | Path | None = None, target: str | None = None, quant: str | None = None, *,
                 config: EngineConfig | None = None, **settings: Any):
        from mlcc.runtime.core.tokenizer import Tokenizer
        from mlcc.runtime.device.model import LoadedModel
        from mlcc.runtime.jit import resolve_model
        from mlcc.targets import detect_local

        if target is not None:
            settings["target"] = target
        if quant is not None:
            settings["quant"] = quant
        cfg = EngineConfig.of(config, **settings)
        if cfg.target == "auto":
            cfg = dataclasses.replace(cfg, target=detect_local())
        self.speculative_config = parse_speculative_config(cfg.speculative_config)   # refused before any loading
        wants_lora = cfg.lora is not None or bool(cfg.max_loras or cfg.max_lora_rank)
        self.model_dir = resolve_model(model, cfg.target, cfg.quant, cfg.tensor_parallel or 1, cfg.options,
                                       cfg.kv_cache_dtype, lora=_lora_build(cfg) if wants_lora else None)
        if wants_lora:
            artifact.check_lora(artifact.read_config(self.model_dir), cfg.max_loras, cfg.max_lora_rank,
                                self.model_dir)
        built_tp = int(artifact.read_config(self.model_dir).get("tensor_parallel", 1))
        if cfg.tensor_parallel is not None and cfg.tensor_parallel != built_tp:
            raise artifact.ArtifactError(
                f"{self.model_dir} was compiled for --tensor-parallel {built_tp}, not {cfg.tensor_parallel}; "
                f"recompile with `mlcc compile SOURCE --target {cfg.target} --tensor-parallel {cfg.tensor_parallel} "
                "--output DIR`")
        if built_tp > 1:
            from mlcc.runtime.device.tensor_parallel import TensorParallelModel

            self.model = TensorParallelModel(self.model_dir)
        else:
            self.model = LoadedModel(self.model_dir, device_id=cfg.device_id, weights=cfg.weights,
                                     num_threads=cfg.num_threads)
        model_cfg = self.model.config
        self.model_name = (hub.source_name(Path(model_cfg["source"]["path"])) if "source" in model_cfg
                           else self.model_dir.name)
        self.tokenizer = Tokenizer(self.model_dir, model_cfg["tokenizer"])
        context_window = min(cfg.context_window or self.model.context_window, self.model.context_window)
        cfg = dataclasses.replace(cfg, context_window=context_window)
        if cfg.kv_cache_tokens is not None and self.model.device_kind != "cpu" and \
                cfg.kv_cache_tokens > self._kv_budget_tokens(cfg):
            raise EngineConfigError(
                f"kv_cache_tokens={cfg.kv_cache_tokens} does not fit: this GPU has room for about "
                f"{self._kv_budget_tokens(cfg)} at gpu_memory_utilization={cfg.gpu_memory_utilization}; lower it, "
                "leave it unset (sized from free memory), or raise --gpu-memory-utilization")
        kv_cache_tokens = max(cfg.kv_cache_tokens or self._default_kv_tokens(cfg), 64)
        self.config = cfg = dataclasses.replace(cfg, kv_cache_tokens=kv_cache_tokens,
                                                prefill_chunk=min(cfg.prefill_chunk, kv_cache_tokens))
        forks = not self.model.has_sliding_window   # windows over a forked prefix are not exact (prefix_cache)
        self.core = EngineCore(self.model, Sampler.for_model(self.model), cfg, prefix_forks=forks,
                               make_speculator=self._speculator_factory(cfg))
        self.chat = _Chat(self)
        self.completions = _Completions(self)
        self.lora_adapters: dict[str, LoraAdapter] = {}
        for name, path in (cfg.lora or {}).items():
            self.load_lora(name, path)
        log.info("engine ready: %s on %s, KV cache %d tokens (%.0f MB), batch %d, prefix cache %s, speculative %s",
                 self.model_name, model_cfg["target"], kv_cache_tokens,
                 kv_cache_tokens * _kv_bytes_per_token(model_cfg) / 1e6, cfg.max_batch,
                 "on" if cfg.prefix_cache else "off",
                 self.speculative_config.method if self.speculative_config else "off")

    @property
    def context_window(self) -> int:
        return self.config.context_window

    @property
    def kv_cache_tokens(self) -> int:
        return self.config.kv_cache_tokens

    @property
    def vision(self) -> dict[str, Any] | None:
        """How this model takes images (mlcc-config.json's `vision`: preprocessing, image tokens); None: text only."""
        return self.model.config.get("vision")

    # -- LoRA adapters -------------------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path) -> LoraAdapter:
        """Serve the PEFT adapter in folder `path` as model `name` (requests pick it by their `model` field); refused
        in one line where this build serves no adapters or the adapter does not fit it."""
        if self.model.lora is None:
            artifact.check_lora(self.model.config, None, None, self.model_dir)
        if not name or name == self.model_name:
            raise LoraAdapterError(f"LoRA adapter name {name!r}: give it a name other than the base model's")
        if name in self.lora_adapters:
            raise LoraAdapterError(f"The lora adapter '{name}' has already been loaded; unload it first")
        adapter = read_adapter(name, path, self.model.lora.layout)
        self.lora_adapters[name] = adapter
        return adapter

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`; requests already running on it finish with it."""
        if self.lora_adapters.pop(name, None) is None:
            raise LoraAdapterError(f"The lora adapter '{name}' cannot be found")

    def adapter_for(self, model: str | None) -> LoraAdapter | None:
        """The adapter a request's `model` field names (None: the base model)."""
        return self.lora_adapters.get(model) if model else None

    def _speculator_factory(self, cfg: EngineConfig):
        """How the engine core builds its Speculator (None without speculation); a draft model is loaded here, on
        the target's device, and must share its tokenizer."""
        config = self.speculative_config
        if config is None:
            return None
        draft = None
        if config.method == "draft":
            from mlcc.runtime.device.model import LoadedModel
            from mlcc.runtime.jit import resolve_model
            from mlcc.runtime.spec.draft import DraftProposer, check_same_tokenizer

            path = Path(config.model)
            if not path.exists() and hub.parse_name(config.model) is None:
                raise SpeculativeConfigError(f"speculative_config.model: {path}: no such model folder or file (nor "
                                             "a Hugging Face repo name)")
            draft_dir = resolve_model(config.model, cfg.target, config.quantization)
            check_same_tokenizer(self.model_dir, draft_dir)
            model = LoadedModel(draft_dir, device_id=cfg.device_id, num_threads=cfg.num_threads)
            draft = DraftProposer(model, self.model.vocab, cfg.max_batch, cfg.kv_cache_tokens, cfg.prefill_chunk)
            log.info("draft model %s (%d speculative tokens)", draft_dir, config.num_speculative_tokens)

        def make(model, page_size: int, stats) -> Speculator:
            return Speculator(config, model, page_size, stats, draft)

        return make

    def _default_kv_tokens(self, cfg: EngineConfig) -> int:
        """Enough for max_batch full contexts, within the memory budget (_kv_budget_tokens)."""
        return int(min(cfg.context_window * cfg.max_batch, self._kv_budget_tokens(cfg)))

    def _kv_budget_tokens(self, cfg: EngineConfig) -> int:
        """KV-cache tokens the memory allows. CPU: 1/4 of the free RAM, at most 2 GiB. GPU: what is free once the
        weights are loaded, less the share of the device gpu_memory_utilization keeps back and an estimate of the
        activations of the largest step (a prefill chunk through the MLP, max_batch rows of float32 logits); refused
        in one line where not even one page's worth fits."""
        model_cfg = self.model.config
        per_token = _kv_bytes_per_token(model_cfg)
        if self.model.device_kind == "cpu":
            import psutil

            return max(min(psutil.virtual_memory().available // 4, 2 << 30) // per_token, 256)
        m = model_cfg["model_config"]
        hidden, inter = m["hidden_size"], m.get("intermediate_size") or 4 * m["hidden_size"]
        # + the float16 scratch a quantized projection's weights are decoded into before a vendor GEMM (the
        # gate/up projection's is the largest)
        activations = (cfg.prefill_chunk * (4 * hidden + 3 * inter) * 4 + 2 * cfg.max_batch * m["vocab_size"] * 4
                       + 2 * 2 * inter * hidden + (1 << 30))
        dev = self.model.dev
        total, free = dev.total_global_memory, dev.available_global_memory
        budget = free - int(total * (1.0 - cfg.gpu_memory_utilization)) - activations
        need = max(cfg.page_size, 256) * per_token
        if budget < need:
            raise EngineConfigError(
                f"GPU memory: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the weights; keeping "
                f"{1 - cfg.gpu_memory_utilization:.0%} back and {activations / 2**30:.1f} GiB for activations leaves "
                f"no room for a KV cache; raise --gpu-memory-utilization, lower --max-batch or --prefill-chunk, or "
                "use a smaller quantization")
        return budget // per_token

    # -- request plumbing ----------------------------------------------------------------------------------------
    def run_sync(self, call: Call) -> Iterator[tuple[int, Event]]:
        """(choice index, event) as they happen; closing the iterator aborts what is still running."""
        q: queue.Queue[tuple[int, Event]] = queue.Queue()
        reqs = call.submit(lambda i, e: q.put((i, e)))
        pending = call.n
        try:
            while pending:
                i, ev = q.get()
                pending -= _finished(ev)
                yield i, ev
        finally:
            self.abort(reqs)

    async def run_async(self, call: Call) -> AsyncIterator[tuple[int, Event]]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        reqs = call.submit(lambda i, e: loop.call_soon_threadsafe(q.put_nowait, (i, e)))
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

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer.encode(text)

    @functools.cached_property
    def grammars(self) -> "structured.GrammarCompiler":
        """Compiles structured-output grammars for this tokenizer (built on first use: about 0.3 s for a
        50k-token vocabulary)."""
        return structured.GrammarCompiler(self.model_dir / "tokenizer.json", self.model.vocab,
                                          self.tokenizer.eos_ids)

    @functools.cached_property
    def tool_format(self) -> "tool_calls.ToolFormat":
        """How this model writes tool calls (runtime.api.tool_calls), from its chat template and architecture."""
        return tool_calls.tool_call_format(self.tokenizer.chat_template or "",
                                           self.model.config.get("model_type"))

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token as logprobs show it: its text and its UTF-8 bytes (a token may hold part of a character)."""
        raw = self.grammars.tokenizer.decode_bytes([token_id])   # special tokens as their text
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:   # part of a character: shown as OpenAI shows it
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

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


def _lora_build(cfg: EngineConfig) -> tuple[int, int]:
    """(max_loras, max_lora_rank) a model compiled on first use for `cfg`'s adapters is built with."""
    paths = list((cfg.lora or {}).values())
    for p in paths:
        if not Path(p).is_dir():
            raise LoraAdapterError(f"--lora: {p} is not a folder (pass a PEFT adapter folder)")
    return (cfg.max_loras or max(4, len(paths)),
            cfg.max_lora_rank or max([16] + [adapter_rank(p) for p in paths]))


def _finished(ev: Event) -> bool:
    """Whether this event ends its sample; a failed step surfaces here as an exception to the caller."""
    if ev.kind == "error":
        raise GenerationError(f"generation failed: {type(ev.error).__name__}: {ev.error}") from ev.error
    return ev.kind == "finish"


def _sync_stream(engine: Engine, call: Call) -> Iterator[Any]:
    yield from call.stream_start()
    for i, ev in engine.run_sync(call):
        yield from call.stream_event(i, ev)
    yield from call.stream_end()


async def _async_stream(engine: Engine, call: Call) -> AsyncIterator[Any]:
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
    """create() for both endpoints; subclasses say how a validated request becomes a Call."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def make_call(self, **kw: Any) -> Call:
        raise NotImplementedError

    def create(self, *, stream: bool = False, **kw: Any):
        call = self.make_call(stream=stream, **kw)
        if stream:
            return _sync_stream(self.engine, call)
        for i, ev in self.engine.run_sync(call):
            call.collect(i, ev)
        return call.result()


class _ChatCompletions(_CreateAPI):
    """engine.chat.completions: create(messages=..., stream=...) → ChatCompletion | Iterator[ChatCompletionChunk]"""

    def make_call(self, **kw: Any) -> Call:
        req = protocol.parse_chat_request(kw)
        return prepare.chat_call(self.engine, req.model_dump(exclude_none=True, by_alias=True))


class _Completions(_CreateAPI):
    """engine.completions: create(prompt=..., stream=...) → Completion | Iterator[Completion]"""

    def make_call(self, **kw: Any) -> Call:
        req = protocol.parse_completion_request(kw)
        return prepare.completion_call(self.engine, req.model_dump(exclude_none=True, by_alias=True))


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


def _has_images(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and
        any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"]) for m in messages)


class _AsyncCreate:
    def __init__(self, engine: Engine, sync_api: _ChatCompletions | _Completions):
        self.engine, self.sync_api = engine, sync_api

    async def create(self, *, stream: bool = False, **kw: Any):
        if _has_images(kw.get("messages")):   # decoding (or fetching) images: off the event loop
            call = await asyncio.to_thread(self.sync_api.make_call, stream=stream, **kw)
        else:
            call = self.sync_api.make_call(stream=stream, **kw)   # validation errors raise here, at the await
        if stream:
            return _async_stream(self.engine, call)
        async for i, ev in self.engine.run_async(call):
            call.collect(i, ev)
        return call.result()

"""One generation request as the scheduler and the engine core see it: its prompt and sampling state, how much of
it the KV cache holds, and its output handling (detokenize, stop checks, events to the caller's sink)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable

import numpy as np

from mlcc.runtime.core.prefix_cache import image_keyed
from mlcc.runtime.core.sampler import SamplingParams
from mlcc.runtime.core.tokenizer import StreamDecoder


@dataclasses.dataclass
class Event:
    kind: str                      # "delta" | "finish" | "error"
    text: str = ""
    token_id: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: BaseException | None = None
    logprob: Any = None            # delta: the token's runtime.core.logit_processing.TokenLogprob, where asked for
    prompt_logprobs: list | None = None   # finish: the prompt's TokenLogprobs (None for its first token), echo
    cached_tokens: int = 0         # finish: prompt tokens whose KV came from the prefix cache


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImage:
    """An image of the prompt: its run of `length` image tokens from position `start`, the encoder's input (float32
    [channels, height, width], preprocessed) and that input's sha256 (what the prefix cache keys its tokens by)."""
    start: int
    length: int
    pixels: np.ndarray
    digest: str


@dataclasses.dataclass(eq=False)
class SharedPrefix:
    """Full KV pages that forked sequences hold together (TVM frees them with the last holder)."""
    pages: int
    cached: int = 0   # of them, pages the parent shares with the prefix cache (other requests may hold them too)
    holders: set = dataclasses.field(default_factory=set)   # the Requests still running on them


@dataclasses.dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    sink: Callable[[Event], None]
    decoder: StreamDecoder | None
    eos_ids: set[int]
    rng: np.random.Generator = dataclasses.field(default_factory=np.random.default_rng)
    # further choices of the same prompt (n > 1): admitted with this request, they are forked from its KV state
    # once its prompt is read, and each samples its first token from the same logits with its own generator
    forks: list["Request"] = dataclasses.field(default_factory=list)
    id: int = dataclasses.field(default_factory=itertools.count().__next__)
    seq_id: int = -1
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # what the KV cache must hold before sampling
    kv_len: int = 0                # tokens in the KV cache: prefill chunks, then one per decode step
    shared: SharedPrefix | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted: int = 0               # chars of `text` already sent
    finish_reason: str | None = None
    cancelled: bool = False
    # what happens to this request's logits (runtime.core.logit_processing): token id -> bias, a grammar matcher
    # (runtime.api.structured.Matcher), and the number of top alternatives its logprobs carry (None: no logprobs)
    logit_bias: dict[int, float] | None = None
    matcher: Any = None
    top_logprobs: int | None = None
    prompt_top_logprobs: int | None = None     # echo with logprobs: score the prompt too
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    # the LoRA adapter it runs with (runtime.device.lora.LoraAdapter; None: the base model)
    lora: Any = None
    # prefix caching (runtime.core.prefix_cache): the cached prefix it is forked from when admitted (a Hit), the fork
    # position, the cached entry, the mirror pages its sequence may share with others and how many of them came
    # from the cache; the prompt tokens its first admission reused (usage); its KV length when preempted
    prefix_hit: Any = None
    fork_pos: int = 0
    source: Any = None
    kv_pages: list = dataclasses.field(default_factory=list)
    cache_pages: int = 0
    cached_tokens: int = 0
    retired_len: int = 0
    # the prompt's images (vision-language models) and, once a prefill first reads one, every image's rows from the
    # encoder ([images, tokens per image, hidden], on the host)
    images: tuple[PromptImage, ...] = ()
    image_rows: Any = None

    def __post_init__(self) -> None:
        self.prefill_ids = list(self.prompt_ids)

    @property
    def lora_key(self) -> int:
        """Its adapter's unique load key (0: none): what its KV state depends on besides the tokens."""
        return self.lora.key if self.lora is not None else 0

    @property
    def reading_prompt(self) -> bool:
        return self.kv_len < len(self.prefill_ids)

    @property
    def processed(self) -> bool:
        """Its logits go through runtime.core.logit_processing (no pipelined decode: each mask needs the last token)."""
        return bool(self.logit_bias) or self.matcher is not None or self.top_logprobs is not None

    @property
    def decoding(self) -> bool:
        """Has sampled a token that the next decode step feeds in."""
        return not self.reading_prompt and bool(self.output_ids) and self.finish_reason is None

    def cache_ids(self, tokens: list[int]) -> list[int]:
        """`tokens` (a prefix of prompt + output) as the prefix cache keys them: image tokens by their image's
        content (runtime.core.prefix_cache.image_keyed)."""
        return image_keyed(tokens, self.images) if self.images else tokens

    def group(self) -> list["Request"]:
        return [self, *self.forks]

    def preempt(self) -> None:
        """Drop the KV state; on re-admission prompt + output so far are recomputed and generation resumes."""
        self.prefill_ids = self.prompt_ids + self.output_ids
        self.retired_len, self.kv_len = self.kv_len, 0
        self.leave_shared()

    def leave_shared(self) -> None:
        if self.shared is not None:
            self.shared.holders.discard(self)
            self.shared = None

    # -- KV pages (the policy's arithmetic: TVM's paged cache gives a sequence ceil(tokens / page_size) pages; the
    # pages of a SharedPrefix are counted once, by the policy, not here) ------------------------------------------
    def held_pages(self, page_size: int) -> int:
        """Pages this request alone holds: removing it frees them (and the shared ones, if it holds them last).
        Pages shared with the prefix cache are not counted: other running requests may hold them too."""
        return math.ceil(self.kv_len / page_size) - max(self.shared.pages if self.shared else 0, self.cache_pages)

    def reserved_pages(self, page_size: int) -> int:
        """Pages this request and the forks it will make may hold alone by the time they finish."""
        total = len(self.prompt_ids) + self.max_new
        own = math.ceil(total / page_size) - (self.shared.pages if self.shared else 0)
        shared = len(self.prompt_ids) // page_size   # a fork shares the full pages of the prompt
        return own + sum(math.ceil((len(f.prompt_ids) + f.max_new) / page_size) - shared for f in self.forks)

    def fork_pages(self, page_size: int) -> int:
        """Pages forking this request's children takes once its prompt is read: each child gets a copy of a
        partly filled last page."""
        return len(self.forks) if len(self.prefill_ids) % page_size else 0

    # -- output handling (runs on the worker thread) -------------------------------------------------------------
    def on_token(self, tid: int, logprob: Any = None) -> None:
        is_eos = tid in self.eos_ids and not self.params.ignore_eos
        if is_eos or tid in self.params.stop_token_ids:
            self.finish_reason = "stop"
            self._flush_decoder()
            self._emit(final=True)
            return
        self.output_ids.append(tid)
        if self.decoder is not None:
            self.text += self.decoder.push(tid)
        for s in self.params.stop:
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                self.finish_reason = "stop"
                self._emit(final=True)
                return
        if len(self.output_ids) >= self.max_new:
            self.finish_reason = "length"
            self._flush_decoder()
        self._emit(final=self.finish_reason is not None, token_id=tid, logprob=logprob)

    def _flush_decoder(self) -> None:
        if self.decoder is not None:
            self.text += self.decoder.flush()

    def _emit(self, final: bool, token_id: int | None = None, logprob: Any = None) -> None:
        # Hold back a tail that could still grow into a stop string.
        hold = 0 if final else max((len(s) - 1 for s in self.params.stop), default=0)
        upto = max(self.emitted, len(self.text) - hold)
        delta = self.text[self.emitted: upto]
        self.emitted = upto
        if delta or token_id is not None:
            self.sink(Event("delta", text=delta, token_id=token_id, logprob=logprob))
        # the "finish" event comes from close(), after the engine core has released the request's KV pages: a
        # caller that sees its request end sees its pages free

    def close(self) -> None:
        self.sink(Event("finish", finish_reason=self.finish_reason, prompt_tokens=len(self.prompt_ids),
                        completion_tokens=len(self.output_ids), cached_tokens=self.cached_tokens,
                        prompt_logprobs=self.prompt_logprobs if self.prompt_top_logprobs is not None else None))

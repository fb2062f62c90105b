"""Iteration-level (continuous) batching over the paged KV cache.

One worker thread owns the model. Each step it admits waiting requests while KV pages allow, runs one ragged
prefill chunk for requests still reading their prompt, then one batched decode for everyone generating. Requests
report through a sink callback (text deltas, then a finish event), so sync, async and HTTP callers share it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import threading
from typing import Callable

import numpy as np

from .decode_pipeline import decode_pipelined
from mlcc.errors import ContextWindowExceededError
from .sampler import Sampler, SamplingParams
from .token_fetch import TokenFetcher
from .tokenizer import StreamDecoder

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Event:
    kind: str                      # "delta" | "finish" | "error"
    text: str = ""
    token_id: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: BaseException | None = None


@dataclasses.dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    sink: Callable[[Event], None]
    decoder: StreamDecoder | None
    eos_ids: set[int]
    id: int = dataclasses.field(default_factory=itertools.count().__next__)
    seq_id: int = -1
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # what the KV cache must hold before sampling
    prefilled: int = 0
    output_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted: int = 0               # chars of `text` already sent
    finish_reason: str | None = None
    cancelled: bool = False
    rng: np.random.Generator = dataclasses.field(default_factory=np.random.default_rng)

    def __post_init__(self) -> None:
        self.prefill_ids = list(self.prompt_ids)

    @property
    def reading_prompt(self) -> bool:
        return self.prefilled < len(self.prefill_ids)

    def preempt(self) -> None:
        """Drop the KV state; on re-admission prompt + output so far are recomputed and generation resumes."""
        self.prefill_ids = self.prompt_ids + self.output_ids
        self.prefilled = 0

    def pages_needed(self, page_size: int) -> int:
        return math.ceil((len(self.prompt_ids) + self.max_new) / page_size)

    # -- output handling (runs on the worker thread) -------------------------------------------------------------
    def on_token(self, tid: int) -> None:
        is_eos = tid in self.eos_ids and not self.params.ignore_eos
        if is_eos or tid in self.params.stop_token_ids:
            self.finish_reason = "stop"
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
        self._emit(final=self.finish_reason is not None, token_id=tid)

    def _emit(self, final: bool, token_id: int | None = None) -> None:
        # Hold back a tail that could still grow into a stop string.
        hold = 0 if final else max((len(s) - 1 for s in self.params.stop), default=0)
        upto = max(self.emitted, len(self.text) - hold)
        delta = self.text[self.emitted: upto]
        self.emitted = upto
        if delta or token_id is not None:
            self.sink(Event("delta", text=delta, token_id=token_id))
        # the "finish" event comes from close(), after the scheduler has released the request's KV pages: a caller
        # that sees its request end sees its pages free

    def close(self) -> None:
        self.sink(Event("finish", finish_reason=self.finish_reason, prompt_tokens=len(self.prompt_ids),
                        completion_tokens=len(self.output_ids)))


class Scheduler:
    def __init__(self, model, sampler: Sampler, max_batch: int, max_total_tokens: int, prefill_chunk: int,
                 page_size: int = 16, policy: str = "no_evict"):
        if policy not in ("no_evict", "max_util"):
            raise ValueError(f"unknown scheduling policy '{policy}'; use no_evict or max_util")
        self.model = model
        self.sampler = sampler
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.page_size = page_size
        self.policy = policy
        model.create_kv_cache(max_batch, max_total_tokens, prefill_chunk, page_size)
        self.total_pages = model.free_pages()
        self.max_total_tokens = max_total_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []
        self._free_seq_ids = list(range(max_batch))
        # a lone request decodes pipelined (runtime.decode_pipeline) where the model can feed ids back and the
        # device reads them back without waiting for later steps (CUDA); elsewhere it would only add a wasted step
        # at the end of each request (tests set pipeline_without_overlap to run the loop on the CPU)
        self._fetcher = TokenFetcher(model.dev) if hasattr(model, "decode_fed_back") else None
        self.pipeline_without_overlap = False
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="mlcc-scheduler", daemon=True)
        self._thread.start()
        self.stats = collections.Counter()

    # -- public, thread-safe -------------------------------------------------------------------------------------
    def check_fits(self, n_prompt: int, max_new: int) -> None:
        need = math.ceil((n_prompt + max_new) / self.page_size)
        if need > self.total_pages:
            raise ContextWindowExceededError(
                f"prompt ({n_prompt} tokens) plus max_tokens ({max_new}) needs {need * self.page_size} KV-cache "
                f"tokens but this engine holds {self.total_pages * self.page_size}; shorten the prompt, lower "
                "max_tokens, or give the engine more KV memory")

    def submit(self, req: Request) -> None:
        with self._cv:
            self.waiting.append(req)
            self._cv.notify()

    def abort(self, req: Request) -> None:
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def pages_in_use(self) -> int:
        return self.total_pages - self.model.free_pages()

    def queue_length(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.active)

    # -- worker --------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.waiting and not self.active:
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - fail the batch, keep the engine alive
                log.exception("engine step failed")
                for r in list(self.active):
                    self._finish(r, error=e)

    def _pending_prefill_pages(self) -> int:
        return sum(math.ceil((len(r.prefill_ids) - r.prefilled) / self.page_size) for r in self.active)

    def _preempt_for_decode(self, running: list[Request]) -> list[Request]:
        """max_util: free pages for this decode step by preempting the most recently admitted requests."""
        while running and self.model.free_pages() < len(running):
            victim = running.pop()
            log.info("preempting request %d (%d tokens) to free KV pages", victim.id,
                     len(victim.prompt_ids) + len(victim.output_ids))
            self.active.remove(victim)
            self.model.remove_sequence(victim.seq_id)
            self._free_seq_ids.append(victim.seq_id)
            victim.preempt()
            with self._cv:
                self.waiting.appendleft(victim)
            self.stats["preempted"] += 1
        return running

    def _reserved_pages(self) -> int:
        return sum(r.pages_needed(self.page_size) for r in self.active)

    def _admit(self) -> None:
        with self._cv:
            while self.waiting and self._free_seq_ids:
                r = self.waiting[0]
                if r.cancelled:
                    self.waiting.popleft()
                    continue
                if self.policy == "no_evict":
                    if self._reserved_pages() + r.pages_needed(self.page_size) > self.total_pages:
                        break  # admit only what is guaranteed to finish
                elif self.model.free_pages() - self._pending_prefill_pages() < \
                        math.ceil(len(r.prefill_ids) / self.page_size) + 1:
                    break  # max_util: admit whatever fits now; decode preempts if pages run out later
                self.waiting.popleft()
                r.seq_id = self._free_seq_ids.pop()
                self.model.add_sequence(r.seq_id)
                self.active.append(r)

    def _finish(self, r: Request, error: BaseException | None = None) -> None:
        if r in self.active:
            self.active.remove(r)
            try:
                self.model.remove_sequence(r.seq_id)
            finally:
                self._free_seq_ids.append(r.seq_id)
        if error is not None:
            r.sink(Event("error", error=error))
        elif r.finish_reason is not None and not r.cancelled:
            r.close()

    def step(self) -> None:
        for r in [r for r in self.active if r.cancelled]:
            self._finish(r)
            self.stats["aborted"] += 1
        self._admit()
        # prefill: one ragged chunk across the requests still reading their prompts
        budget, batch, chunks = self.prefill_chunk, [], []
        for r in self.active:
            if r.reading_prompt and budget > 0:
                take = min(budget, len(r.prefill_ids) - r.prefilled)
                batch.append(r)
                chunks.append(r.prefill_ids[r.prefilled: r.prefilled + take])
                budget -= take
        if batch:
            logits = self.model.prefill([r.seq_id for r in batch], chunks)
            for r, c in zip(batch, chunks):
                r.prefilled += len(c)
            self.stats["prefill_tokens"] += sum(len(c) for c in chunks)
            done = [i for i, r in enumerate(batch) if not r.reading_prompt]
            if done:
                self._sample_and_emit([batch[i] for i in done], logits, rows=done)
        # decode: everyone that has produced a token and is still going
        running = [r for r in self.active if not r.reading_prompt and r.output_ids and r.finish_reason is None
                   and r not in batch]
        if running and self.policy == "max_util":
            running = self._preempt_for_decode(running)
        draw = self.sampler.device_draw(running[0].params, running[0].rng) \
            if len(running) == 1 and len(self.active) == 1 and self._pipelines(running[0]) else None
        if draw is not None:
            self._decode_pipelined(running[0], draw)
        elif running:
            logits = self.model.decode([r.seq_id for r in running], [r.output_ids[-1] for r in running])
            self.stats["decode_tokens"] += len(running)
            self._sample_and_emit(running, logits)
        for r in [r for r in self.active if r.finish_reason is not None]:
            self._finish(r)

    def _pipelines(self, r: Request) -> bool:
        if self._fetcher is None or not (self._fetcher.overlaps or self.pipeline_without_overlap):
            return False
        # max_util admits without reserving pages; a lone request cannot be preempted for them mid-burst
        left = r.max_new - len(r.output_ids)
        return self.policy == "no_evict" or self.model.free_pages() * self.page_size >= left + self.page_size

    def _decode_pipelined(self, r: Request, draw) -> None:
        """Decode the only running request until it ends or another request arrives."""
        def want_more(in_flight: int) -> bool:
            if r.cancelled or r.finish_reason is not None or self._stop:
                return False
            if len(r.output_ids) + in_flight >= r.max_new:
                return False
            with self._cv:
                return not self.waiting

        def on_token(tid: int) -> bool:
            self.stats["decode_tokens"] += 1
            self.stats["pipelined_tokens"] += 1
            if r.cancelled:
                r.finish_reason = "abort"
            else:
                r.on_token(tid)
            return r.finish_reason is None

        decode_pipelined(self.model, r.seq_id, r.output_ids[-1], draw, self._fetcher, want_more, on_token)

    def _sample_and_emit(self, reqs: list[Request], logits, rows: list[int] | None = None) -> None:
        if rows is not None and len(rows) != logits.shape[0]:
            logits = _take_rows(self.model, logits, rows)
        ids = self.sampler.sample(logits, [r.params for r in reqs],
                                  [r.prompt_ids + r.output_ids for r in reqs], [r.rng for r in reqs])
        for r, t in zip(reqs, ids):
            if not r.cancelled:
                r.on_token(t)
            else:
                r.finish_reason = "abort"


def _take_rows(model, logits, rows: list[int]):
    host = logits.numpy()[rows]
    return model._to_dev(host)  # rare: only when some prompts in a prefill batch are still unfinished


"""The engine core: one worker thread that owns the model and executes the scheduler's plans.

Each step it asks the scheduler (runtime.core.scheduler, deciding through runtime.core.policy) for a plan, then runs it: KV
sequences removed (cancelled, preempted) and added (admitted), one ragged prefill chunk, forks of requests whose
prompt is now read, one batched decode step — or, when a single request is running, a pipelined decode burst
(runtime.device.graph_decode) that lasts until the request ends or another one arrives — and hands the sampled tokens to
the requests, which report through their sinks (text deltas, then a finish event), so sync, async and HTTP
callers share it.

With the prefix cache (runtime.core.prefix_cache) an admitted request whose prompt starts like a cached sequence is
forked from it instead of added empty, a request that ends or is preempted leaves its sequence cached, and cached
sequences are evicted (least recently used first) only when a step needs more pages than are free.
"""

from __future__ import annotations

import collections
import logging
import math
import threading

import numpy as np

from mlcc.errors import ContextWindowExceededError
from mlcc.options import EngineConfig
from mlcc.runtime.core.logit_processing import LogitProcessor
from mlcc.runtime.core.policy import Plan, make_policy
from mlcc.runtime.core.prefix_cache import PrefixCache
from mlcc.runtime.core.request import Event, Request
from mlcc.runtime.core.sampler import DeviceDraw, Sampler
from mlcc.runtime.core.scheduler import Scheduler
from mlcc.runtime.device.graph_decode import decode_pipelined
from mlcc.runtime.device.interface import EmbedRows
from mlcc.runtime.device.token_fetch import TokenFetcher
from mlcc.runtime.spec.speculative import Speculator

log = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """A request ended because an engine step failed (its message names the cause)."""


class EngineCore:
    """Runs on the settings of `config` (mlcc.options.EngineConfig, resolved by the Engine: kv_cache_tokens and
    prefill_chunk set): max_batch, kv_cache_tokens, prefill_chunk, page_size, policy, prefix_cache and pipeline —
    decode a lone request pipelined: None where the device reads sampled ids back without waiting for the steps
    queued after them (CUDA); True wherever the model can feed ids back (elsewhere it only adds a wasted step at the
    end of each request: the same tokens, for tests); False never. prefix_forks: reuse cached prefixes by forking
    cached sequences too, not only by continuing them. make_speculator(model, page_size, stats) -> the
    runtime.spec.speculative.Speculator of speculative decoding, or None."""

    def __init__(self, model, sampler: Sampler, config: EngineConfig, prefix_forks: bool = True,
                 make_speculator=None):
        if config.kv_cache_tokens is None:
            raise ValueError("EngineCore needs a resolved config: kv_cache_tokens set")
        self.model = model
        self.sampler = sampler
        self.config = config
        self.page_size = page_size = config.page_size
        self.prefill_chunk = prefill_chunk = min(config.prefill_chunk, config.kv_cache_tokens)
        model.create_kv_cache(config.max_batch, config.kv_cache_tokens, prefill_chunk, page_size)
        self.total_pages = model.free_pages()
        self.failure: Exception | None = None   # what a failed step raised; the engine then serves nothing more
        self.policy = make_policy(config.policy, page_size, self.total_pages, prefill_chunk)
        self.stats: collections.Counter = collections.Counter()
        self.prefix_cache = (PrefixCache(page_size, model.remove_sequence, model.free_pages, forks=prefix_forks)
                             if config.prefix_cache else None)
        self.scheduler = Scheduler(self.policy, config.max_batch, self.stats, self.prefix_cache,
                                   max_adapters=model.lora.capacity if model.lora is not None else 0)
        self.processor = LogitProcessor(model, model.vocab)
        self.speculator: Speculator | None = (make_speculator(model, page_size, self.stats)
                                              if make_speculator is not None else None)
        pipeline = config.pipeline
        feeds_back = hasattr(model, "decode_fed_back")
        self._fetcher = TokenFetcher(model.dev) if feeds_back and pipeline is not False else None
        self._pipeline = self._fetcher is not None and (pipeline or (pipeline is None and self._fetcher.overlaps))
        self._thread = threading.Thread(target=self._loop, name="mlcc-engine-core", daemon=True)
        self._thread.start()

    # -- public, thread-safe -------------------------------------------------------------------------------------
    def check_fits(self, n_prompt: int, max_new: int) -> None:
        need = math.ceil((n_prompt + max_new) / self.page_size)
        if need > self.total_pages:
            raise ContextWindowExceededError(
                f"prompt ({n_prompt} tokens) plus max_tokens ({max_new}) needs {need * self.page_size} KV-cache "
                f"tokens but this engine holds {self.total_pages * self.page_size}; shorten the prompt, lower "
                "max_tokens, or give the engine more KV memory")

    def submit(self, req: Request) -> None:
        if self.failure is not None:
            raise GenerationError(f"the engine failed ({type(self.failure).__name__}: {self.failure}) and serves no "
                                  "more requests; restart it")
        self.scheduler.submit(req)

    def abort(self, req: Request) -> None:
        self.scheduler.abort(req)

    def shutdown(self) -> None:
        self.scheduler.close()
        self._thread.join(timeout=10)

    def pages_in_use(self) -> int:
        """Pages running requests hold (not those only the prefix cache holds)."""
        return self.total_pages - self.available_pages()

    def free_pages(self) -> int:
        return self.model.free_pages()

    def cached_pages(self) -> int:
        """Pages only the prefix cache holds (evicted when needed)."""
        return self.prefix_cache.evictable_pages if self.prefix_cache is not None else 0

    def available_pages(self) -> int:
        return self.model.free_pages() + self.cached_pages()

    def queue_length(self) -> int:
        return self.scheduler.queue_length()

    def num_running(self) -> int:
        return self.scheduler.num_running()

    # -- worker --------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while self.scheduler.wait_for_work():
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - fail every request; the server reports the failure
                log.exception("engine step failed")
                # the device may be left in any state (a CUDA fault poisons the context): serve nothing more, so
                # that the server reports unhealthy and gets restarted rather than failing request after request
                self.failure = e
                for r in self.scheduler.fail_all():
                    try:
                        if r.seq_id >= 0:
                            self.model.remove_sequence(r.seq_id)
                    except Exception:  # noqa: BLE001 - not added, or already removed
                        pass
                    if self.prefix_cache is not None:
                        self.prefix_cache.released(r.kv_pages)
                    if self.speculator is not None:
                        self.speculator.release(r)
                    r.sink(Event("error", error=e))

    def step(self) -> None:
        plan, cancelled = self.scheduler.schedule(self.available_pages())
        if not (cancelled or plan.preempt or plan.admit or plan.prefill or plan.decode):
            self.scheduler.wait_for_change(0.05)   # queued requests wait for pages: no busy loop
            return
        for r in cancelled:
            self._retire(r, r.kv_len)
        for r in plan.preempt:
            self._retire(r, r.retired_len)
        self._admit(plan.admit)
        if self.prefix_cache is not None:
            need = self.policy.step_pages(plan)
            if need > self.model.free_pages() and not self.prefix_cache.evict_until(need):
                log.warning("a step needs %d KV pages, %d are free after evicting the prefix cache", need,
                            self.model.free_pages())
        if plan.prefill:
            self._prefill(plan)
        if plan.decode:
            self._decode(plan.decode)
        for r in [r for r in self.scheduler.running if r.finish_reason is not None]:
            self._finish(r)

    def _admit(self, admit: list[Request]) -> None:
        """Admitted requests get their sequences: forked from a cached prefix, or empty."""
        cache, ps = self.prefix_cache, self.page_size
        if cache is not None:
            copies = sum(1 for r in admit if r.prefix_hit is not None and r.prefix_hit.pos % ps)
            if copies > self.model.free_pages():   # a fork copies a partly filled page: keep the entries forked
                cache.evict_until(copies, keep=[r.prefix_hit.entry for r in admit if r.prefix_hit is not None])
        hits = collections.Counter(id(r.prefix_hit.entry) for r in admit if r.prefix_hit is not None)
        for r in admit:
            hit, r.prefix_hit = r.prefix_hit, None
            if hit is None:
                self.model.add_sequence(r.seq_id)
            elif hits[id(hit.entry)] == 1 and cache.takes_over(hit):   # its only taker: continue that sequence
                r.seq_id = hit.entry.seq_id
                extra = self.model.seq_lens.get(r.seq_id, hit.pos) - hit.pos
                if extra > 0:
                    self.model.popn(r.seq_id, extra)
                r.cache_pages = cache.taken(hit, r.kv_pages)
                self.stats["cached_prefill_tokens"] += hit.pos
            else:
                if hit.pos % ps and self.model.free_pages() == 0:   # no page to copy into: share full pages only
                    hit.pos -= hit.pos % ps
                    # nor part of an image: its tokens are read in one forward (Gemma 3's see each other)
                    inside = next((img.start for img in r.images if img.start < hit.pos < img.start + img.length),
                                  None)
                    if inside is not None:
                        hit.pos = inside - inside % ps
                    r.kv_len = hit.pos
                    if not r.output_ids:
                        r.cached_tokens = min(hit.pos, len(r.prompt_ids))
                self.model.fork_sequence(hit.entry.seq_id, r.seq_id, hit.pos)
                r.cache_pages = cache.forked(hit, r.kv_pages)
                r.source, r.fork_pos = hit.entry, hit.pos
                self.stats["cached_prefill_tokens"] += hit.pos
            self._bind_adapter(r)
            if cache is not None and not r.output_ids:
                cache.record_query(len(r.prompt_ids), r.cached_tokens)

    def _bind_adapter(self, r: Request) -> None:
        """r's sequence reads its LoRA adapter's pool slot, the adapter written into one first where it is in none
        (the scheduler admitted no more distinct adapters than there are slots)."""
        pool = self.model.lora
        if pool is None:
            return
        slot = None
        if r.lora is not None:
            slot = pool.acquire(r.lora, {q.lora_key for q in self.scheduler.running if q.lora is not None})
        pool.bind(r.seq_id, slot)

    def _retire(self, r: Request, kv_len: int) -> None:
        """A request's sequence leaves the running batch with `kv_len` tokens of KV: it stays cached (with the
        prefix cache) or is removed."""
        if self.speculator is not None:
            self.speculator.release(r)
        if self.model.lora is not None:
            self.model.lora.bind(r.seq_id, None)
        cache = self.prefix_cache
        if cache is None:
            self.model.remove_sequence(r.seq_id)
            return
        extra = self.model.seq_lens.get(r.seq_id, kv_len) - kv_len
        if extra > 0:   # a pipelined decode's wasted last step
            self.model.popn(r.seq_id, extra)
        tokens = r.cache_ids((r.prompt_ids + r.output_ids)[:kv_len])
        cache.insert(r.seq_id, tokens, r.kv_pages, r.source, r.fork_pos, len(r.prompt_ids), r.lora_key)
        r.source, r.fork_pos, r.cache_pages = None, 0, 0

    def _prefill(self, plan: Plan) -> None:
        scored = [(r, n) for r, n in plan.prefill if self._scores_prompt(r)]
        batched = [(r, n) for r, n in plan.prefill if not self._scores_prompt(r)]
        with_images = [(r, n) for r, n in batched if self.model.bidirectional_images and
                       any(img.start < r.kv_len + n and img.start + img.length > r.kv_len for img in r.images)]
        batched = [(r, n) for r, n in batched if all(r is not q for q, _ in with_images)]
        sampled, all_logits, rows = [], [], []
        for r, n in with_images:   # each on its own: its images in forwards of their own
            chunk, logits = self._prefill_with_images(r, n)
            self._read([r], [chunk])
            self._ready_to_sample([r], logits, sampled, all_logits, rows)
        if batched:
            reqs = [r for r, _ in batched]
            chunks = [r.prefill_ids[r.kv_len: r.kv_len + n] for r, n in batched]
            images = [self._image_rows(r, r.kv_len, r.kv_len + n) for r, n in batched]
            logits = self.model.prefill([r.seq_id for r in reqs], chunks, images if any(images) else None)
            self._read(reqs, chunks)
            self._ready_to_sample(reqs, logits, sampled, all_logits, rows)
        for r, n in scored:   # its own call: logits at every position of the chunk
            start, chunk = r.kv_len, r.prefill_ids[r.kv_len: r.kv_len + n]
            logits = self.model.prefill_all(r.seq_id, chunk)
            self._read([r], [chunk])
            targets = r.prefill_ids[start + 1: start + n + 1]
            scored_rows = self.processor.prompt_logprobs(logits, targets + [0] * (n - len(targets)),
                                                         r.prompt_top_logprobs)
            r.prompt_logprobs += scored_rows[: len(targets)]
            if not r.reading_prompt:
                last = self.model.to_device(np.ascontiguousarray(logits.numpy()[n - 1: n]))
                self._ready_to_sample([r], last, sampled, all_logits, rows)
        self.stats["prefill_steps"] += 1
        for logits, group, group_rows in zip(all_logits, sampled, rows):
            self._sample_and_emit(group, logits, group_rows)

    def _image_rows(self, r: Request, start: int, stop: int) -> EmbedRows | None:
        """The encoder's rows for the image tokens among r's prefill tokens start..stop, or None. The encoder runs
        once per request, when a prefill first reaches one of its images: not at all where the prefix cache already
        holds them."""
        hit = [img for img in r.images if img.start < stop and img.start + img.length > start]
        if not hit:
            return None
        if r.image_rows is None:
            r.image_rows = self.model.embed_images(np.stack([img.pixels for img in r.images]))
            self.stats["images_encoded"] += len(r.images)
        offsets, rows = [], []
        for img in r.images:
            lo, hi = max(start, img.start), min(stop, img.start + img.length)
            if lo < hi:
                offsets.append(np.arange(lo - start, hi - start))
                rows.append(r.image_rows[r.images.index(img), lo - img.start: hi - img.start])
        return EmbedRows(np.concatenate(offsets), np.concatenate(rows))

    def _prefill_with_images(self, r: Request, n: int) -> tuple[list[int], object]:
        """Up to n of r's prefill tokens, each whole image among them prefilled on its own with its tokens attending
        to each other both ways (as Gemma 3 reads images), the text around them causally. The chunk stops before an
        image it would cut; an image longer than a forward may take is read causally (logged). Returns the tokens
        read and the logits of the last one."""
        start, stop = r.kv_len, r.kv_len + n
        limit = min(self.model.max_prefill_chunk or self.prefill_chunk, self.prefill_chunk)
        for img in r.images:
            if img.start < stop < img.start + img.length and img.start > start:
                stop = img.start
        cuts = sorted({start, stop} | {p for img in r.images for p in (img.start, img.start + img.length)
                                       if start < p < stop})
        logits = None
        for a, b in zip(cuts, cuts[1:]):
            whole = any(img.start == a and img.start + img.length == b for img in r.images)
            if whole and b - a > limit:
                log.warning("an image of %d tokens exceeds a forward's %d: its tokens attend causally", b - a, limit)
            rows = self._image_rows(r, a, b)
            logits = self.model.prefill([r.seq_id], [r.prefill_ids[a:b]], [rows] if rows is not None else None,
                                        bidirectional=whole and b - a <= limit)
        return r.prefill_ids[start:stop], logits

    @staticmethod
    def _scores_prompt(r: Request) -> bool:
        """echo with logprobs: the prompt's own tokens are scored (once: not again after a preemption)."""
        return r.prompt_top_logprobs is not None and r.kv_len < len(r.prompt_ids)

    def _read(self, reqs: list[Request], chunks: list[list[int]]) -> None:
        for r, c in zip(reqs, chunks):
            r.kv_len += len(c)
        self.stats["prefill_tokens"] += sum(len(c) for c in chunks)

    def _ready_to_sample(self, reqs: list[Request], logits, sampled: list, all_logits: list, rows: list) -> None:
        """Those of reqs (rows of logits) whose prompt is now read draw their first token; with n > 1 every
        choice draws from that row with its own generator. A request with max_tokens 0 ends here."""
        group, group_rows = [], []
        for i, r in enumerate(reqs):
            if r.reading_prompt:
                continue
            members = [r]
            if r.forks:
                members += self.scheduler.forked(r)
                for f in members[1:]:
                    self.model.fork_sequence(r.seq_id, f.seq_id)
                    self._bind_adapter(f)
                    f.prompt_logprobs = list(r.prompt_logprobs)
                    f.cached_tokens = r.cached_tokens
                    if self.prefix_cache is not None:
                        self.prefix_cache.shared(r.cache_ids(r.prefill_ids), r.kv_pages, f.kv_pages, r.kv_len,
                                                 r.lora_key)
            if r.max_new == 0:
                for m in members:
                    m.finish_reason = "length"
                continue
            group += members
            group_rows += [i] * len(members)
        if group:
            sampled.append(group)
            all_logits.append(logits)
            rows.append(group_rows)

    def _decode(self, running: list[Request]) -> None:
        spec = self.speculator
        if spec is not None:   # speculating requests verify their proposals; the rest decode below
            running = spec.step(running, self._emit_token)
            if not running:
                return
        # a burst lasts until another request arrives: with one already waiting (for pages), decode step by step;
        # so does a request whose speculation is paused (its cool-down counts steps: it resumes after them)
        if len(running) == 1 and self.scheduler.num_running() == 1 and self._pipeline and \
                not self.scheduler.has_waiting() and self.policy.may_burst(running[0], self.available_pages()) and \
                (spec is None or not (spec.wants(running[0], 1) or spec.paused(running[0]))):
            draw = self._device_draw(running[0])
            if draw is not None:
                self._decode_pipelined(running[0], draw)
                return
        logits = self.model.decode([r.seq_id for r in running], [r.output_ids[-1] for r in running])
        for r in running:
            r.kv_len += 1
        self.stats["decode_tokens"] += len(running)
        self._sample_and_emit(running, logits)

    @staticmethod
    def _emit_token(r: Request, tid: int) -> bool:
        """A speculative step's token to r; whether r goes on."""
        if r.cancelled:
            r.finish_reason = "abort"
            return False
        r.on_token(tid)
        return r.finish_reason is None

    def _device_draw(self, r: Request) -> DeviceDraw | None:
        """How a lone request's next id is drawn on the device: with its logit_bias and grammar mask applied
        first (logprobs need the host: never pipelined)."""
        draw = self.sampler.device_draw(r.params, r.rng)
        if draw is None or not r.processed:
            return draw
        if r.top_logprobs is not None:
            return None
        process, sample = self.processor.before_sampling, draw.sample
        return DeviceDraw(lambda logits: sample(process(logits, [r], None)[0]), draw.prepare,
                          after_token=r.matcher is not None)

    def _decode_pipelined(self, r: Request, draw: DeviceDraw) -> None:
        """Decode the only running request until it ends or another request arrives."""
        cached = self.prefix_cache is not None

        def want_more(in_flight: int) -> bool:
            if r.cancelled or r.finish_reason is not None or self.scheduler.closed:
                return False
            if len(r.output_ids) + in_flight >= r.max_new:
                return False
            if cached and (r.kv_len + in_flight) % self.page_size == 0 and self.model.free_pages() == 0:
                return False   # the next step needs a page the prefix cache holds: evicted by the next step()
            return not self.scheduler.has_waiting()

        def on_token(tid: int) -> bool:
            r.kv_len += 1   # the step that produced it fed the previous token in
            self.stats["decode_tokens"] += 1
            self.stats["pipelined_tokens"] += 1
            if r.cancelled:
                r.finish_reason = "abort"
            else:
                if r.matcher is not None:
                    r.matcher.accept(tid)
                r.on_token(tid)
            return r.finish_reason is None

        decode_pipelined(self.model, r.seq_id, r.output_ids[-1], draw, self._fetcher, want_more, on_token)

    def _sample_and_emit(self, reqs: list[Request], logits, rows: list[int] | None = None) -> None:
        raw = None
        if self.processor.active(reqs):
            logits, raw = self.processor.before_sampling(logits, reqs, rows)
            rows = None
        ids = self.sampler.sample(logits, [r.params for r in reqs], [(r.prompt_ids, r.output_ids) for r in reqs],
                                  [r.rng for r in reqs], rows=rows)
        logprobs = self.processor.after_sampling(raw, reqs, ids) if raw is not None else [None] * len(reqs)
        for r, t, lp in zip(reqs, ids, logprobs):
            if not r.cancelled:
                r.on_token(t, lp)
            else:
                r.finish_reason = "abort"

    def _finish(self, r: Request) -> None:
        self.scheduler.finish(r)
        self._retire(r, r.kv_len)
        if not r.cancelled:
            r.close()

"""The request queues and KV-cache sequence slots of continuous batching.

Callers submit and abort from any thread; the engine core's worker asks `schedule(free_pages)` for each step's
plan, which the policy (runtime.core.policy) decides from the queues and which is applied to them here, and reports
back what ended (`finish`) and what forked (`forked`). Nothing here touches the model.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading

from mlcc.runtime.core.policy import Plan, Policy
from mlcc.runtime.core.prefix_cache import PrefixCache
from mlcc.runtime.core.request import Request, SharedPrefix

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, policy: Policy, max_batch: int, stats: collections.Counter | None = None,
                 prefix_cache: PrefixCache | None = None, max_adapters: int = 0):
        """max_adapters: the LoRA adapters the running batch may use at once (the device pool's slots)."""
        self.policy = policy
        self.max_batch = max_batch
        self.max_adapters = max_adapters
        self.prefix_cache = prefix_cache
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # sequence ids are never reused: a request's sequence may stay in the KV cache as a cached prefix
        self._seq_ids = itertools.count()
        self._free_slots = max_batch
        self.stats = stats if stats is not None else collections.Counter()
        self._cv = threading.Condition()
        self._closed = False

    # -- callers' side (thread-safe) -----------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request (with its forks, which run on the prompt it reads once)."""
        with self._cv:
            self.waiting.extend(self._split(req))
            self._cv.notify_all()

    def abort(self, req: Request) -> None:
        with self._cv:
            req.cancelled = True
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_for_work(self) -> bool:
        """Block until something is queued or running; False once closed."""
        with self._cv:
            while not self._closed and not self.waiting and not self.running:
                self._cv.wait()
            return not self._closed

    def wait_for_change(self, timeout: float) -> None:
        """A step found nothing to do: sleep until a submit or an abort, or the timeout."""
        with self._cv:
            self._cv.wait(timeout)

    def has_waiting(self) -> bool:
        with self._cv:
            return bool(self.waiting)

    def queue_length(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    def _split(self, req: Request) -> list[Request]:
        """A group that could never be admitted at once (more choices than sequence slots, or than KV pages under
        no_evict) runs as independent requests, each prefilling the prompt itself."""
        out = [req]
        while req.forks and (len(req.group()) > self.max_batch or
                             req.reserved_pages(self.policy.page_size) > self.policy.total_pages):
            out.insert(1, req.forks.pop())
        return out

    # -- the worker's side ---------------------------------------------------------------------------------------
    def schedule(self, free_pages: int) -> tuple[Plan, list[Request]]:
        """This step's plan, already applied to the queues, and the running requests that were cancelled (the
        worker removes their sequences)."""
        with self._cv:
            cancelled = [r for r in self.running if r.cancelled]
            for r in cancelled:
                orphans = [f for f in r.forks if not f.cancelled]   # not forked yet: they read the prompt themselves
                self._release(r)
                r.forks = []
                self.waiting.extendleft(reversed(orphans))
                self.stats["aborted"] += 1
            self._drop_cancelled_waiting()
            prepared: list[Request] = []
            plan = self.policy.schedule(self._admissible(), list(self.running), free_pages, self._free_slots,
                                        prepare=lambda admit: prepared.extend(self._match(admit)))
            for r in prepared:
                if r not in plan.admit:   # not admitted after all: it looks up again when it is
                    self._unmatch(r)
            for r in plan.admit:
                assert self.waiting[0] is r
                self.waiting.popleft()
                for q in r.group():
                    q.seq_id = next(self._seq_ids)
                self._free_slots -= len(r.group())
                self.running.append(r)
            # the victims' slots are freed after the admissions (the policy admitted into the slots free before),
            # and each keeps its seq_id until re-admitted: the worker removes that sequence first
            for r in plan.preempt:   # most recent first: the earliest victim ends up at the queue's front
                log.info("preempting request %d (%d tokens) to free KV pages", r.id,
                         len(r.prompt_ids) + len(r.output_ids))
                self._release(r)
                r.preempt()
                self.waiting.appendleft(r)
                self.stats["preempted"] += 1
            return plan, cancelled

    def forked(self, parent: Request) -> list[Request]:
        """`parent` has read its prompt: its forks become running requests of their own, sharing its full
        pages. Returns those not cancelled meanwhile (the worker forks their sequences)."""
        with self._cv:
            forks, parent.forks = parent.forks, []
            live = [f for f in forks if not f.cancelled]
            self._free_slots += len(forks) - len(live)
            if live:
                shared = SharedPrefix(parent.kv_len // self.policy.page_size, cached=parent.cache_pages)
                for r in [parent, *live]:
                    r.shared = shared
                    shared.holders.add(r)
                for f in live:
                    f.kv_len = parent.kv_len
                i = self.running.index(parent) + 1
                self.running[i:i] = live
            return live

    def finish(self, r: Request) -> None:
        with self._cv:
            if r in self.running:
                self._release(r)

    def fail_all(self) -> list[Request]:
        """A step failed: every running and waiting request (and the forks they carry) ends; returns them."""
        with self._cv:
            failed = [q for r in [*self.running, *self.waiting] for q in r.group()]
            for r in list(self.running):
                self._release(r)
            self.waiting.clear()
            return failed

    def _release(self, r: Request) -> None:
        """Out of the running list; its sequence slot (and its forks', if not forked yet) free again."""
        self.running.remove(r)
        self._free_slots += len(r.group())
        r.leave_shared()

    def _match(self, admit: list[Request]) -> list[Request]:
        """Admitted requests start from the longest cached prefix of what they must prefill: the engine core forks
        it (runtime.core.prefix_cache). Returns those that found one."""
        cache, found = self.prefix_cache, []
        if cache is None:
            return found
        for r in admit:
            if r.kv_len or r.prompt_top_logprobs is not None:   # echo's prompt scoring needs every position
                continue
            hit = cache.match(r.cache_ids(r.prefill_ids), r.lora_key)
            if not r.output_ids:
                r.cached_tokens = min(hit.pos, len(r.prompt_ids)) if hit else 0
            if hit is not None:
                r.prefix_hit, r.kv_len, r.cache_pages = hit, hit.pos, hit.pos // self.policy.page_size
                found.append(r)
        return found

    def _admissible(self) -> list[Request]:
        """The queue up to the first request whose LoRA adapter finds no slot: one beyond max_adapters distinct
        adapters in the running batch and those admitted before it (it waits, in order, for one to finish)."""
        used = {r.lora_key for r in self.running if r.lora is not None}
        out = []
        for r in self.waiting:
            if r.lora is not None and r.lora_key not in used:
                if len(used) >= self.max_adapters:
                    break
                used.add(r.lora_key)
            out.append(r)
        return out

    def _unmatch(self, r: Request) -> None:
        r.prefix_hit, r.kv_len, r.cache_pages = None, 0, 0

    def _drop_cancelled_waiting(self) -> None:
        """Cancelled requests leave the queue unseen. Forks of a cancelled request that are still wanted run on
        their own."""
        kept: list[Request] = []
        for r in self.waiting:
            if r.cancelled:
                kept.extend(f for f in r.forks if not f.cancelled)
                r.forks = []
            else:
                r.forks = [f for f in r.forks if not f.cancelled]
                kept.append(r)
        self.waiting = collections.deque(kept)

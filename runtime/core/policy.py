"""Scheduling policies: from the requests' states and the KV cache's free pages, the plan of one engine step.

A policy decides and changes nothing: runtime.core.scheduler applies its plan to the queues, runtime.engine_core runs it on the
model. Page arithmetic follows TVM's paged KV cache: a sequence of n tokens holds ceil(n / page_size) pages, a
decode step takes a new page only for a sequence whose pages are full, and a fork shares the parent's full pages
and copies a partly filled last one.
Pages only the prefix cache holds (runtime.core.prefix_cache) count as free: the engine core evicts them when a step
needs them. A request forked from a cached prefix is charged all its pages (others may share them), but its
preemption is counted to free only those it holds beyond the cached prefix.

- no_evict: admit a request only when the pages every running request may still need, plus its own, fit in the
  cache; nothing is ever preempted.
- max_util: admit whatever fits now; when a step would need more pages than are free, preempt the most recently
  admitted requests (their KV state is dropped, or left to the prefix cache, and recomputed on re-admission as far
  as it is no longer cached) until it fits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from mlcc.runtime.core.request import Request


@dataclasses.dataclass
class Plan:
    """One engine step, run in this order: drop the preempted sequences, add the admitted ones, one ragged prefill
    chunk, one decode step."""
    preempt: list[Request] = dataclasses.field(default_factory=list)  # back to the queue's front, recomputed later
    admit: list[Request] = dataclasses.field(default_factory=list)    # from the queue's front, in order
    prefill: list[tuple[Request, int]] = dataclasses.field(default_factory=list)  # (request, prompt tokens read now)
    decode: list[Request] = dataclasses.field(default_factory=list)   # one token each

    def drop(self, r: Request) -> None:
        self.prefill = [(q, n) for q, n in self.prefill if q is not r]
        self.decode = [q for q in self.decode if q is not r]


class Policy:
    name = ""

    def __init__(self, page_size: int, total_pages: int, prefill_chunk: int):
        self.page_size, self.total_pages, self.prefill_chunk = page_size, total_pages, prefill_chunk

    def schedule(self, waiting: Sequence[Request], running: Sequence[Request], free_pages: int,
                 free_slots: int, prepare: Callable[[list[Request]], None] | None = None) -> Plan:
        """waiting: the queue, oldest first; running: admitted requests in admission order; free_pages: pages free
        or held only by the prefix cache (evicted on demand); free_slots: sequences the cache can still add.
        prepare(admitted): runs before the prefill chunk is cut (the prefix cache sets what each already holds)."""
        admit = self.admit(waiting, running, free_pages, free_slots)
        if prepare is not None:
            prepare(admit)
        active = [*running, *admit]
        plan = Plan(admit=admit, prefill=self.chunk(active), decode=[r for r in active if r.decoding])
        self.make_room(plan, running, free_pages)
        return plan

    def chunk(self, active: Sequence[Request]) -> list[tuple[Request, int]]:
        """The step's prefill: prompts read in admission order, prefill_chunk tokens in all."""
        budget, out = self.prefill_chunk, []
        for r in active:
            if r.reading_prompt and budget > 0:
                take = min(budget, len(r.prefill_ids) - r.kv_len)
                out.append((r, take))
                budget -= take
        return out

    def step_pages(self, plan: Plan) -> int:
        """Pages the plan's prefill chunk (and the forks it completes) and decode step take."""
        ps, need = self.page_size, 0
        for r, take in plan.prefill:
            need += math.ceil((r.kv_len + take) / ps) - math.ceil(r.kv_len / ps)
            if r.kv_len + take == len(r.prefill_ids):
                need += r.fork_pages(ps)
        return need + sum(1 for r in plan.decode if r.kv_len % ps == 0)

    def admit_pages(self, plan: Plan) -> int:
        """Pages the plan's forks from the prefix cache take from the available ones: the shared full pages (no
        longer evictable, unless another running request holds them already) and a copied partly filled page."""
        return sum(math.ceil(r.prefix_hit.pos / self.page_size) for r in plan.admit if r.prefix_hit is not None)

    def admit(self, waiting: Sequence[Request], running: Sequence[Request], free_pages: int,
              free_slots: int) -> list[Request]:
        raise NotImplementedError

    def make_room(self, plan: Plan, running: Sequence[Request], free_pages: int) -> None:
        """Preempt (or not admit after all) what the step has no pages for."""

    def may_burst(self, r: Request, free_pages: int) -> bool:
        """Whether a lone request may decode a pipelined burst (it cannot be preempted mid-burst)."""
        return True


def shared_pages(requests: Sequence[Request]) -> int:
    """Pages of the shared prefixes these requests hold, each counted once."""
    return sum(s.pages for s in {id(r.shared): r.shared for r in requests if r.shared is not None}.values())


class NoEvict(Policy):
    name = "no_evict"

    def admit(self, waiting, running, free_pages, free_slots):
        ps = self.page_size
        reserved = sum(r.reserved_pages(ps) for r in running) + shared_pages(running)
        out = []
        for r in waiting:   # in order: a request that does not fit yet waits at the front, so none overtakes it
            need = r.reserved_pages(ps)
            if len(r.group()) > free_slots or reserved + need > self.total_pages:
                break
            out.append(r)
            reserved += need
            free_slots -= len(r.group())
        return out


class MaxUtil(Policy):
    name = "max_util"

    def admit(self, waiting, running, free_pages, free_slots):
        ps = self.page_size
        # what the running requests' prompts and next decode step still take
        pending = sum(math.ceil(len(r.prefill_ids) / ps) - math.ceil(r.kv_len / ps) + r.fork_pages(ps)
                      for r in running if r.reading_prompt)
        avail = free_pages - pending - sum(1 for r in running if r.decoding and r.kv_len % ps == 0)
        out = []
        for r in waiting:
            prompt = math.ceil(len(r.prefill_ids) / ps) + r.fork_pages(ps)
            # +1: room for its first decode step, beside others; alone, a request always fits (check_fits)
            margin = 1 if running or out else 0
            if len(r.group()) > free_slots or avail < prompt + margin:
                break
            out.append(r)
            avail -= prompt
            free_slots -= len(r.group())
        return out

    def make_room(self, plan, running, free_pages):
        free = free_pages
        candidates = [*running, *plan.admit]
        while self.step_pages(plan) + self.admit_pages(plan) > free and candidates:
            victim = candidates.pop()   # the most recently admitted
            plan.drop(victim)
            if victim in plan.admit:
                plan.admit.remove(victim)   # holds no pages yet: simply not admitted this step
                continue
            plan.preempt.append(victim)
            free += victim.held_pages(self.page_size)
            s = victim.shared
            if s is not None and all(h in plan.preempt for h in s.holders):
                free += s.pages - s.cached   # its last holder goes: TVM frees the shared pages too

    def may_burst(self, r, free_pages):
        left = r.max_new - len(r.output_ids)
        return free_pages * self.page_size >= left + self.page_size


POLICIES = {p.name: p for p in (NoEvict, MaxUtil)}


def make_policy(name: str, page_size: int, total_pages: int, prefill_chunk: int) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy '{name}'; use {' or '.join(POLICIES)}")
    return POLICIES[name](page_size, total_pages, prefill_chunk)

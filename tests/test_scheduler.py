"""Scheduling decisions without a model: admission order, page reservation (no_evict), preemption (max_util),
chunked prefill, forked choices (n > 1). Page size 16 throughout."""

from __future__ import annotations

import math

import pytest

from mlcc.runtime.core.policy import MaxUtil, NoEvict, Plan, make_policy
from mlcc.runtime.core.request import Request
from mlcc.runtime.core.sampler import SamplingParams
from mlcc.runtime.core.scheduler import Scheduler

PS = 16


def req(prompt: int, max_new: int, forks: int = 0) -> Request:
    r = Request(list(range(prompt)), SamplingParams(), max_new, lambda e: None, None, set())
    r.forks = [Request(r.prompt_ids, SamplingParams(), max_new, lambda e: None, None, set()) for _ in range(forks)]
    return r


def decoding(prompt: int, generated: int) -> Request:
    """A running request that has read its prompt and decoded: kv holds prompt + generated - 1 tokens (the last
    sampled token is fed in by the next step)."""
    r = req(prompt, 1000)
    r.kv_len = prompt + generated - 1
    r.output_ids = [1] * generated
    return r


def run(plan: Plan, sched: Scheduler | None = None) -> None:
    """What the engine core does with a plan, minus the model: prompts read, one token sampled or decoded."""
    for r, n in plan.prefill:
        r.kv_len += n
        if not r.reading_prompt:
            group = [r] + (sched.forked(r) if sched is not None else [])
            for q in group:
                q.output_ids.append(7)
    for r in plan.decode:
        r.kv_len += 1
        r.output_ids.append(7)


def test_no_evict_admits_in_order_and_a_big_request_is_not_overtaken():
    p = NoEvict(PS, total_pages=10, prefill_chunk=512)
    a, big, small = req(20, 20), req(100, 60), req(5, 5)            # 3, 10 and 1 pages reserved
    assert [r.reserved_pages(PS) for r in (a, big, small)] == [3, 10, 1]
    assert p.schedule([a, big, small], [], free_pages=10, free_slots=4).admit == [a]
    # `big` fits once `a` is gone; `small` still waits behind it
    assert p.schedule([big, small], [], free_pages=10, free_slots=4).admit == [big]
    # sequence slots bound admission too
    assert p.schedule([small, a], [], free_pages=10, free_slots=1).admit == [small]


def test_no_evict_reserves_what_running_requests_may_still_need():
    running = decoding(16, 1)              # holds 1 page now, may grow to 16 + 64 tokens: 5 pages
    running.max_new = 64
    newcomer = req(16, 80)                 # 6 pages
    plan = NoEvict(PS, total_pages=10, prefill_chunk=512).schedule([newcomer], [running], free_pages=9, free_slots=3)
    assert plan.admit == [] and plan.decode == [running] and plan.preempt == []
    # max_util admits it: its prompt (1 page) and a first decode step fit in what is free now
    plan = MaxUtil(PS, total_pages=10, prefill_chunk=512).schedule([newcomer], [running], free_pages=9, free_slots=3)
    assert plan.admit == [newcomer] and plan.prefill == [(newcomer, 16)]


def test_max_util_preempts_the_most_recent_request_when_pages_run_out():
    p = MaxUtil(PS, total_pages=7, prefill_chunk=512)
    a, b, c = decoding(17, 16), decoding(17, 16), decoding(17, 16)   # 32 tokens each: full pages, 2 held
    plan = p.schedule([], [a, b, c], free_pages=2, free_slots=1)      # the step needs 3 new pages
    assert plan.preempt == [c] and plan.decode == [a, b]
    assert p.step_pages(plan) <= 2 + c.held_pages(PS)
    # with room on their last pages nobody needs a page: nothing is preempted
    for r in (a, b, c):
        r.kv_len += 1
    assert p.schedule([], [a, b, c], free_pages=0, free_slots=1).preempt == []


def test_preempted_request_goes_back_first_and_is_recomputed():
    sched = Scheduler(make_policy("max_util", PS, 7, 512), max_batch=4)
    a, b, c = req(17, 100), req(17, 100), req(17, 100)
    for r in (a, b, c):
        sched.submit(r)
    plan, _ = sched.schedule(free_pages=7)
    assert plan.admit == [a, b, c]
    run(plan, sched)
    for r in (a, b, c):   # decoded to full pages: each step now needs three new pages, and two are free
        r.kv_len, r.output_ids = 32, [7] * 16
    late = req(3, 5)
    sched.submit(late)
    plan, _ = sched.schedule(free_pages=2)
    assert plan.preempt == [c] and plan.admit == [] and list(sched.waiting) == [c, late]
    assert c.kv_len == 0 and c.prefill_ids == c.prompt_ids + [7] * 16 and c.reading_prompt
    assert sched.running == [a, b]
    # once pages are back, the victim is admitted before the later request and re-reads prompt + output
    a.finish_reason = b.finish_reason = "length"
    sched.finish(a), sched.finish(b)
    plan, _ = sched.schedule(free_pages=7)
    assert plan.admit[0] is c and plan.prefill[0] == (c, 33)


def test_chunked_prefill_spreads_prompts_over_steps_within_the_budget():
    sched = Scheduler(make_policy("no_evict", PS, 100, prefill_chunk=8), max_batch=4)
    a, b = req(20, 3), req(6, 3)
    sched.submit(a), sched.submit(b)
    steps = []
    for _ in range(5):
        plan, _ = sched.schedule(free_pages=100)
        steps.append(([(r is a and "a" or "b", n) for r, n in plan.prefill], ["ab"[r is b] for r in plan.decode]))
        run(plan)
    assert steps == [([("a", 8)], []), ([("a", 8)], []), ([("a", 4), ("b", 4)], []), ([("b", 2)], ["a"]),
                     ([], ["a", "b"])]
    assert (a.kv_len, a.output_ids, b.kv_len, b.output_ids) == (22, [7, 7, 7], 7, [7, 7])


def test_forked_choices_are_admitted_together_and_share_the_prompt_pages():
    p = NoEvict(PS, total_pages=10, prefill_chunk=512)
    group = req(20, 10, forks=2)       # 30 tokens: 2 pages; each fork shares the prompt's one full page
    assert group.reserved_pages(PS) == 2 + 2 * (2 - 1)
    assert p.schedule([group], [], free_pages=10, free_slots=2).admit == []      # three sequences, two slots
    sched = Scheduler(p, max_batch=4)
    sched.submit(group)
    plan, _ = sched.schedule(free_pages=10)
    assert plan.admit == [group] and len({r.seq_id for r in group.group()}) == 3
    assert p.step_pages(plan) == 2 + 2   # the prompt's pages, and a copy of the partly filled page per fork
    forks = list(group.forks)
    run(plan, sched)
    assert sched.running == [group, *forks] and all(f.kv_len == 20 and f.output_ids == [7] for f in forks)
    assert [r.held_pages(PS) for r in sched.running] == [1, 1, 1] and group.shared.pages == 1
    assert group.shared.holders == {group, *forks}


def test_shared_prompt_pages_are_freed_only_with_their_last_holder():
    mu = MaxUtil(PS, total_pages=10, prefill_chunk=512)
    sched = Scheduler(mu, max_batch=4)
    group = req(16, 10, forks=2)      # the prompt fills its page: all of it is shared, no page is copied
    forks = list(group.forks)
    sched.submit(group)
    plan, _ = sched.schedule(free_pages=10)
    assert mu.step_pages(plan) == 1
    run(plan, sched)
    assert [r.held_pages(PS) for r in sched.running] == [0, 0, 0]
    # each of the three needs a new page for its next step; preempting forks frees nothing while one holder stays
    plan = mu.schedule([], sched.running, free_pages=1, free_slots=1)
    assert plan.preempt == [forks[1], forks[0]] and plan.decode == [group]
    plan = mu.schedule([], sched.running, free_pages=0, free_slots=1)
    assert plan.preempt == [forks[1], forks[0], group] and plan.decode == []


def test_a_group_that_can_never_run_at_once_runs_as_separate_requests():
    sched = Scheduler(make_policy("no_evict", PS, 100, 512), max_batch=2)
    group = req(5, 5, forks=2)
    third = group.forks[1]
    sched.submit(group)
    assert list(sched.waiting) == [group, third] and len(group.forks) == 1
    sched = Scheduler(make_policy("no_evict", PS, 3, 512), max_batch=8)   # 3 pages: the parent's 2 and 1 fork
    group = req(20, 10, forks=2)
    sched.submit(group)
    assert len(sched.waiting) == 2 and group.reserved_pages(PS) <= 3


def test_cancelled_requests_leave_and_their_wanted_forks_run_alone():
    sched = Scheduler(make_policy("no_evict", PS, 100, 512), max_batch=4)
    group, other = req(5, 5, forks=2), req(5, 5)
    wanted, unwanted = group.forks
    sched.submit(group), sched.submit(other)
    sched.abort(group), sched.abort(unwanted)
    plan, cancelled = sched.schedule(free_pages=100)
    assert cancelled == [] and plan.admit == [wanted, other] and wanted.forks == []
    # a running request that is cancelled is handed back for its sequence to be removed
    sched.abort(other)
    plan, cancelled = sched.schedule(free_pages=100)
    assert cancelled == [other] and sched.running == [wanted] and sched.stats["aborted"] == 1


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="no_evict or max_util"):
        make_policy("fifo", PS, 10, 512)


def test_pages_follow_tvms_paged_cache():
    r = decoding(20, 5)                    # 24 tokens in the cache
    assert r.held_pages(PS) == math.ceil(24 / PS)
    assert MaxUtil(PS, 10, 512).may_burst(r, free_pages=1) is False   # 995 tokens left, one page free
    assert NoEvict(PS, 10, 512).may_burst(r, free_pages=0) is True


def test_max_util_admits_a_lone_recomputed_request_that_fills_the_cache():
    """A preempted request re-reads prompt + output: alone it is admitted even without a spare page."""
    r = req(40, 56)                        # 96 tokens: 6 pages, the whole cache
    r.output_ids = [7] * 55
    r.preempt()
    assert len(r.prefill_ids) == 95
    assert MaxUtil(PS, total_pages=6, prefill_chunk=512).schedule([r], [], free_pages=6, free_slots=4).admit == [r]

"""Speculative decoding inside continuous batching: requests that speculate this step get proposals (n-gram lookup,
runtime.spec.ngram, or a draft model, runtime.spec.draft), and the target scores all of them in one ragged forward
(PagedModel.verify: every speculating request's last token and its proposals, logits at every position); the
acceptance (runtime.spec.rejection) keeps a prefix of each request's proposals and draws one more token, and the
rejected proposals' KV is popped (TVM's PopN), so a request's KV holds exactly its tokens after every step (what
the prefix cache caches). Requests that do not speculate this step decode in the usual batched step.

Who speculates: requests without logit processing (logit_bias, grammars and logprobs need a mask or a readback per
token: they decode plainly), with at least two tokens left, while the batch is no larger than
disable_by_batch_size. Proposals are capped by the tokens left (the KV never outgrows prompt + max_tokens, what
no_evict reserves), by the free KV pages beyond what the step's plain decodes need, and by the prefill chunk. A
request whose proposals keep being rejected (fewer than MIN_ACCEPTED kept per verify over the last WINDOW) stops
speculating for a cool-down of plain steps that doubles each time it happens again.

Where speculation cannot pay it stays off: at start the speculator times one decode step and one verify of k + 1
tokens on a scratch sequence (plus, for a draft model, k of its decode steps); a speculative step yields at most
k + 1 tokens, so when it costs more than k + 1 decode steps (a GPU whose batch-1 decode is far faster than its
few-token forward, a draft almost as slow as the target) every request decodes plainly and a warning says why.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from mlcc.runtime.core.request import Request
from mlcc.runtime.spec.draft import DraftProposer
from mlcc.runtime.spec.ngram import propose_ngram
from mlcc.runtime.spec.rejection import accept, accept_greedy
from mlcc.runtime.spec.spec_config import SpeculativeConfig

log = logging.getLogger(__name__)

WINDOW = 4               # verify steps the acceptance is judged over
MIN_ACCEPTED = 0.5       # proposals kept per verify below which a request pauses speculating
COOLDOWN = (16, 512)     # plain steps of the first pause, and the longest
SCRATCH_SEQ = 1 << 30    # the cost probe's sequence id (requests' ids count up from 0)
PROBE_CONTEXT = 64       # tokens of context the probe's steps attend to


@dataclasses.dataclass
class _State:
    kept: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=WINDOW))
    cooldown: int = 0
    pause: int = COOLDOWN[0]


class Speculator:
    """model: the target (runtime.device.model.PagedModel); stats: the engine core's counters; draft: the draft
    model's proposer for method "draft"."""

    def __init__(self, config: SpeculativeConfig, model: Any, page_size: int, stats: collections.Counter,
                 draft: DraftProposer | None = None):
        self.config, self.model, self.page_size, self.stats, self.draft = config, model, page_size, stats, draft
        self.k = config.num_speculative_tokens
        # greedy verification from the compiled argmax (not on the CPU: there the logits are on the host already,
        # and numpy's argmax beats a VM call)
        self.device_argmax = model.device_kind != "cpu" and getattr(model, "argmax", None) is not None
        self._state: dict[Request, _State] = {}
        # a speculative step's cost in plain decode steps (None: not measured)
        self.step_cost = speculative_step_cost(model, self.k, draft.model if draft is not None else None)
        self.enabled = self.step_cost is None or self.step_cost < self.k + 1
        if not self.enabled:
            log.warning("speculative decoding stays off: a step (%s of %d tokens) costs %.1f decode steps on this "
                        "device, more than the %d tokens it can yield; every request decodes plainly",
                        "a draft and a verify" if draft is not None else "a verify", self.k + 1, self.step_cost,
                        self.k + 1)
        elif self.step_cost is not None:
            log.info("speculative step: %.1f decode steps for up to %d tokens", self.step_cost, self.k + 1)

    # -- metrics ------------------------------------------------------------------------------------------------
    def acceptance_rate(self) -> float:
        """Proposed tokens the target kept, of all proposed."""
        proposed = self.stats["spec_draft_tokens"]
        return self.stats["spec_accepted_tokens"] / proposed if proposed else 0.0

    def mean_tokens_per_step(self) -> float:
        """Tokens a speculating request emits per verify step (1 + kept proposals; plain decoding: 1)."""
        drafts = self.stats["spec_drafts"]
        return self.stats["spec_emitted_tokens"] / drafts if drafts else 0.0

    # -- per request ---------------------------------------------------------------------------------------------
    def wants(self, r: Request, batch: int) -> bool:
        """Whether r may speculate this step (not whether it has proposals)."""
        limit = self.config.disable_by_batch_size
        if not self.enabled or r.processed or r.cancelled or r.max_new - len(r.output_ids) < 2 or \
                (limit is not None and batch > limit):
            return False
        s = self._state.get(r)
        return s is None or s.cooldown == 0

    def paused(self, r: Request) -> bool:
        """r stopped speculating for a cool-down (of plain steps, counted by step())."""
        s = self._state.get(r)
        return s is not None and s.cooldown > 0

    def release(self, r: Request) -> None:
        """r left the running batch (finished, aborted, preempted, failed)."""
        self._state.pop(r, None)
        if self.draft is not None:
            self.draft.release(r)

    # -- one step ------------------------------------------------------------------------------------------------
    def step(self, running: list[Request], emit: Callable[[Request, int], bool]) -> list[Request]:
        """Verify proposals for the requests that speculate; returns the others (they decode plainly).
        emit(r, token) hands a token to r and says whether r goes on."""
        for r in running:
            s = self._state.get(r)
            if s is not None and s.cooldown:
                s.cooldown -= 1
        wanted = [r for r in running if self.wants(r, len(running))]
        if not wanted:
            return running
        ps = self.page_size
        # pages beyond those every decode of this step needs anyway (the policy counted those)
        spare = self.model.free_pages() - sum(1 for r in running if r.kv_len % ps == 0)
        budget = self.model.prefill_chunk - len(running)
        caps = []
        for r in wanted:
            k = min(self.k, r.max_new - len(r.output_ids) - 1, budget)
            if self.model.max_prefill_chunk:
                k = min(k, self.model.max_prefill_chunk - 1)
            while k > 0 and _pages(r.kv_len, k + 1, ps) - (r.kv_len % ps == 0) > spare:
                k -= 1
            if k > 0:
                spare -= _pages(r.kv_len, k + 1, ps) - (r.kv_len % ps == 0)
                budget -= k
                caps.append((r, k))
        proposals = self._propose(caps)
        spec = [r for r, _ in caps if proposals.get(r, ([], None))[0]]
        if spec:
            self._verify(spec, proposals, emit)
        return [r for r in running if r not in proposals or not proposals[r][0]]

    def _propose(self, caps: Sequence[tuple[Request, int]]) -> dict[Request, tuple[list[int], Any]]:
        if self.draft is not None:
            return self.draft.propose(caps)
        c = self.config
        return {r: (propose_ngram(r.prompt_ids + r.output_ids, k, c.prompt_lookup_min, c.prompt_lookup_max), None)
                for r, k in caps}

    def _verify(self, spec: list[Request], proposals: dict, emit: Callable[[Request, int], bool]) -> None:
        lists = [[r.output_ids[-1], *proposals[r][0]] for r in spec]
        out = self.model.verify([r.seq_id for r in spec], lists)
        self.stats["spec_forwards"] += 1
        # greedy without penalties needs only each position's argmax: the logits can stay on the device and one
        # id per position comes back (k + 1 rows of a 150k vocabulary are ~3 MB to copy every step)
        on_device = self.device_argmax and all(r.params.greedy and not r.params.penalised for r in spec)
        if on_device:
            best = self.model.argmax(out).numpy()
        else:
            logits = out.numpy()
        row = 0
        for r, fed in zip(spec, lists):
            drafts, q = proposals[r]
            if on_device:
                tokens, kept = accept_greedy(best[row: row + len(fed)], drafts)
            else:
                tokens, kept = accept(logits[row: row + len(fed)], drafts, q, r.params, r.prompt_ids,
                                      r.output_ids, r.rng)
            row += len(fed)
            done = 0
            for t in tokens:
                done += 1
                if not emit(r, t):
                    break
            # the KV holds the last token and the proposals; keep those the emitted tokens followed
            r.kv_len += done
            extra = len(fed) - done
            if extra:
                self.model.popn(r.seq_id, extra)
            if self.draft is not None:
                self.draft.verified(r, kept)
            self._record(r, len(drafts), kept, done)

    def _record(self, r: Request, proposed: int, kept: int, emitted: int) -> None:
        st = self.stats
        st["spec_drafts"] += 1
        st["spec_draft_tokens"] += proposed
        st["spec_accepted_tokens"] += kept
        st["spec_emitted_tokens"] += emitted
        st["decode_tokens"] += emitted
        s = self._state.setdefault(r, _State())
        s.kept.append(kept)
        if len(s.kept) == WINDOW:
            if sum(s.kept) / WINDOW < MIN_ACCEPTED:
                s.cooldown, s.pause = s.pause, min(2 * s.pause, COOLDOWN[1])
                s.kept.clear()
                st["spec_pauses"] += 1
                if self.draft is not None:   # its KV would only fall behind: read again when resuming
                    self.draft.release(r)
            elif sum(s.kept) / WINDOW >= 2 * MIN_ACCEPTED:
                s.pause = COOLDOWN[0]


def step_seconds(model: Any, tokens: int, repeats: int = 5) -> tuple[float, float]:
    """(one decode step, one verify forward over `tokens` tokens) in seconds, the fastest of `repeats` (other work on
    the machine only adds to a time), on a scratch sequence of PROBE_CONTEXT tokens that is removed again."""
    ids = [1 + i % (int(model.vocab) - 1) for i in range(PROBE_CONTEXT + tokens)]
    model.add_sequence(SCRATCH_SEQ)
    try:
        model.prefill([SCRATCH_SEQ], [ids[:PROBE_CONTEXT]]).numpy()
        decode, verify = [], []
        for _ in range(repeats + 1):  # the first of each warms up
            t = time.perf_counter()
            model.decode([SCRATCH_SEQ], [ids[PROBE_CONTEXT]]).numpy()
            decode.append(time.perf_counter() - t)
            model.popn(SCRATCH_SEQ, 1)
            t = time.perf_counter()
            model.verify([SCRATCH_SEQ], [ids[PROBE_CONTEXT:]]).numpy()
            verify.append(time.perf_counter() - t)
            model.popn(SCRATCH_SEQ, tokens)
        return min(decode[1:]), min(verify[1:])
    finally:
        model.remove_sequence(SCRATCH_SEQ)


def speculative_step_cost(model: Any, k: int, draft_model: Any = None) -> float | None:
    """What a speculative step of k proposals costs in the target's decode steps: the verify of k + 1 tokens, and
    k decode steps of the draft model if there is one. None where the model cannot be probed (no free pages)."""
    if model.free_pages() * model.page_size < PROBE_CONTEXT + k + 16:
        return None
    try:
        decode, verify = step_seconds(model, k + 1)
        cost = verify / decode
        if draft_model is not None:
            cost += k * step_seconds(draft_model, 1)[0] / decode
    except Exception as e:  # noqa: BLE001 - a probe that fails must not stop the engine; speculation then decides
        log.warning("speculative decoding: could not time a step (%s); speculating without a cost check", e)
        return None
    return cost


def _pages(kv_len: int, n: int, ps: int) -> int:
    """Pages a sequence of kv_len tokens takes to grow by n."""
    return math.ceil((kv_len + n) / ps) - math.ceil(kv_len / ps)


__all__ = ["Speculator", "np"]

"""Speculative acceptance on the host: which proposed tokens a request keeps, drawn so that the output has exactly
the target model's distribution (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
Decoding", algorithm 1).

For proposal i (drafted from distribution q_i; an n-gram proposal is a point mass, q_i = 1 at its token) with the
target's distribution p_i at that position: keep it with probability min(1, p_i(d) / q_i(d)); at the first
rejection draw from the residual norm(max(0, p_i - q_i)) and stop; if every proposal is kept, draw one more token
from p_{k+1}. Greedy requests keep a proposal exactly when it is the target's argmax and end with the argmax, so
their output is plain greedy decoding's. p is runtime.core.sampler.target_probs: the same penalties, temperature,
top-k and top-p as the plain sampler. The verify step's logits come to the host for this (on the CPU they are
there already); the compiled on-device sampler is not used for speculating requests.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mlcc.runtime.core.sampler import SamplingParams, apply_penalties, target_probs


def accept(logits: np.ndarray, drafts: Sequence[int], q: np.ndarray | None, params: SamplingParams,
           prompt: Sequence[int], output: Sequence[int], rng: np.random.Generator) -> tuple[list[int], int]:
    """logits: [len(drafts) + 1, vocab], row i scores the token after drafts[:i]; q: [len(drafts), vocab] draft
    distributions, None for point masses. Returns (the tokens to emit: the kept proposals and one drawn token,
    the number of proposals kept)."""
    out: list[int] = []
    history = list(output)
    for i, d in enumerate(drafts):
        if params.greedy:
            row = logits[i]
            if params.penalised:
                row = apply_penalties(row.astype(np.float64), params, (prompt, history))
            best = int(np.argmax(row))
            if best != d:
                return out + [best], i
        else:
            p = target_probs(logits[i], params, (prompt, history))
            qd = 1.0 if q is None else float(q[i, d])
            if not rng.random() < (min(1.0, p[d] / qd) if qd > 0 else 0.0):
                if q is None:
                    residual = p.copy()
                    residual[d] = 0.0
                else:
                    residual = np.maximum(p - _fit(q[i], p.size), 0.0)
                total = residual.sum()
                residual = residual / total if total > 0 else p   # p == q up to rounding: p itself
                return out + [int(rng.choice(residual.size, p=residual))], i
        out.append(int(d))
        history.append(int(d))
    last = logits[len(drafts)]
    if params.greedy:
        row = apply_penalties(last.astype(np.float64), params, (prompt, history)) if params.penalised else last
        return out + [int(np.argmax(row))], len(drafts)
    p = target_probs(last, params, (prompt, history))
    return out + [int(rng.choice(p.size, p=p))], len(drafts)


def _fit(q: np.ndarray, n: int) -> np.ndarray:
    """A draft distribution over the target's rows (vocabularies padded to different sizes)."""
    if q.size == n:
        return q
    return q[:n] if q.size > n else np.concatenate([q, np.zeros(n - q.size)])


def accept_greedy(best: Sequence[int], drafts: Sequence[int]) -> tuple[list[int], int]:
    """accept() for a greedy request without penalties, from the argmax of each row alone (best[i]: the argmax
    of logits row i, len(drafts) + 1 of them): the proposals up to the first that is not the argmax, then it."""
    for i, d in enumerate(drafts):
        if int(best[i]) != d:
            return [int(t) for t in drafts[:i]] + [int(best[i])], i
    return [int(t) for t in drafts] + [int(best[len(drafts)])], len(drafts)

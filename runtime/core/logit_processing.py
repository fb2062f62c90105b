"""What happens to a step's logits between the model and the sampler, and right after sampling: `logit_bias` and
grammar masks applied on the device, logprobs computed there.

A grammar's mask for the next token is filled on the host while the device still runs the step that produces the
logits (the model's calls only queue work), then uploaded as one bitmask and applied before sampling. Logprobs are
of the model's own distribution (the logits before bias and masks, as vLLM reports them by default); only the
sampled token's value and the top alternatives come back, never the vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from mlcc.runtime.core.request import Request

TOP_LOGPROBS = 20   # the most alternatives a request may ask for (the compiled `logprobs` returns this many)


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, logprob), most likely first


class LogitProcessor:
    """model: a PagedModel with mask_logits, bias_logits, logprobs and to_device (runtime.device.model)."""

    def __init__(self, model: Any, vocab_size: int):
        self.model = model
        self.words = math.ceil(vocab_size / 32)
        self._mask = np.full((0, self.words), -1, np.int32)

    @staticmethod
    def active(reqs: Sequence[Request]) -> bool:
        return any(r.processed for r in reqs)

    def before_sampling(self, logits: Any, reqs: Sequence[Request], rows: Sequence[int] | None) -> tuple[Any, Any]:
        """(logits to sample from, one row per request; the model's own logits in the same rows)."""
        n = len(reqs)
        if rows is not None and list(rows) != list(range(int(logits.shape[0]))):
            # choices of one prompt share a row but keep their own masks: give each its own row (first token only)
            logits = self.model.to_device(np.ascontiguousarray(logits.numpy()[list(rows)]))
        raw = logits
        biased = [(i, t, b) for i, r in enumerate(reqs) if r.logit_bias for t, b in r.logit_bias.items()]
        if biased:
            i, t, b = (np.asarray(c, dtype) for c, dtype in zip(zip(*biased), (np.int32, np.int32, np.float32)))
            logits = self.model.bias_logits(logits, i, t, b)
        if any(r.matcher is not None for r in reqs):
            if self._mask.shape[0] < n:
                self._mask = np.full((n, self.words), -1, np.int32)
            mask = self._mask[:n]
            for i, r in enumerate(reqs):
                if r.matcher is not None:
                    r.matcher.fill_mask(mask, i)
                else:
                    mask[i] = -1
            logits = self.model.mask_logits(logits, mask)
        return logits, raw

    def after_sampling(self, raw: Any, reqs: Sequence[Request], ids: Sequence[int]) -> list[TokenLogprob | None]:
        """Each matcher takes its token; the logprobs of those that asked."""
        for r, t in zip(reqs, ids):
            if r.matcher is not None and not r.cancelled:
                r.matcher.accept(int(t))
        if not any(r.top_logprobs is not None for r in reqs):
            return [None] * len(reqs)
        lp, top_ids, top_lp = self.model.logprobs(raw, np.asarray(ids, np.int32))
        return [None if r.top_logprobs is None else
                TokenLogprob(int(ids[i]), float(lp[i]),
                             [(int(top_ids[i, k]), float(top_lp[i, k])) for k in range(r.top_logprobs)])
                for i, r in enumerate(reqs)]

    def prompt_logprobs(self, logits_all: Any, targets: Sequence[int], top: int) -> list[TokenLogprob]:
        """logits_all[j] predicts targets[j]: the logprob of each and its `top` alternatives."""
        lp, top_ids, top_lp = self.model.logprobs(logits_all, np.asarray(targets, np.int32))
        return [TokenLogprob(int(targets[j]), float(lp[j]), [(int(top_ids[j, k]), float(top_lp[j, k]))
                                                             for k in range(top)])
                for j in range(len(targets))]

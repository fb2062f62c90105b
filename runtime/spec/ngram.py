"""N-gram proposals (prompt lookup decoding, vLLM's "ngram"): the request's last n tokens, for n from
prompt_lookup_max down to prompt_lookup_min, are looked up earlier in its prompt and output; the tokens that
followed the most recent earlier occurrence are proposed. Code edits and quotes copy long spans, which this
predicts for free (no model)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix; [] if none matches."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.size
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = arr[size - n:]
        # windows that start before the suffix and end before the last token (something follows them)
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start:start + k]]
    return []

"""Batch-1 decode with the sampled id fed back on the device and read one step late.

A synchronous step leaves the GPU idle while the host reads the sampled id, queues the next step's KV-cache
metadata and launches it (~0.3 ms of every 8B step on an H200: bench/results, issue 4). Here step k is queued with
step k-1's sampled id still on the device, and only then is that id read: the host's work for a step overlaps the
GPU's work on the one before. When a token ends the request, the step queued behind it is wasted; its KV entry
belongs to a sequence the caller removes. Greedy tokens are the same as the synchronous loop's (tested).
"""

from __future__ import annotations

from typing import Callable

from .token_fetch import TokenFetcher


def decode_pipelined(model, seq_id: int, token: int, sample: Callable, fetcher: TokenFetcher,
                     want_more: Callable[[int], bool], on_token: Callable[[int], bool]) -> None:
    """Decode `seq_id` from `token` (its last sampled id, already handed out) until told to stop.

    sample(logits) -> device int32[1], the next id; want_more(in_flight) -> whether one more step may be queued
    while `in_flight` (0 or 1) steps' ids are still unread; on_token(id) -> whether the request is still live.
    Every queued step's id reaches on_token unless an earlier one ended the request."""
    ids = model.ids_to_device([token])
    pending = None
    while True:
        go = want_more(0 if pending is None else 1)
        if go:
            # step k-1's id is copied behind step k's KV metadata and ahead of its kernels (TokenFetcher)
            before = (lambda p=pending: fetcher.push(p)) if pending is not None else None
            following = sample(model.decode_fed_back(seq_id, ids, before))
        elif pending is not None:
            fetcher.push(pending)
        if pending is not None and not on_token(fetcher.pop()[0]):
            return
        if not go:
            return
        pending = ids = following

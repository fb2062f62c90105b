"""Batch-1 decode with the sampled id fed back on the device and read one step late.

A synchronous step leaves the GPU idle while the host reads the sampled id, hands it out (detokenize, stop
checks, stream it), copies it back and launches the next step. Here step k is launched with step k-1's sampled id
still on the device, and step k-1's id is handed out while step k runs. What cannot overlap is TVM's KV-cache
metadata copy: BeginForward's arrays go to the device on a separate stream into one buffer, so step k's may only
be queued once step k-1 has finished (measured on the H200: queuing it earlier corrupts the running step). When a
token ends the request, the step queued behind it is wasted; its KV entry belongs to a sequence the caller
removes. Greedy tokens are the same as the synchronous loop's (tested).
"""

from __future__ import annotations

from typing import Callable

from .sampler import DeviceDraw
from .token_fetch import TokenFetcher


def decode_pipelined(model, seq_id: int, token: int, draw: DeviceDraw, fetcher: TokenFetcher,
                     want_more: Callable[[int], bool], on_token: Callable[[int], bool]) -> None:
    """Decode `seq_id` from `token` (its last sampled id, already handed out) until told to stop.

    draw: the next id from the logits, left on the device (Sampler.device_draw); want_more(in_flight) -> whether
    one more step may be queued while `in_flight` (0 or 1) steps' ids are still unread; on_token(id) -> whether the
    request is still live.
    Every queued step's id reaches on_token unless an earlier one ended the request."""
    ids = model.ids_to_device([token])
    unread, tail = False, None
    while True:
        go = want_more(1 if unread else 0)
        got = None
        if unread:
            # TVM copies step k's KV-cache metadata on a stream of its own into one buffer: queue it only once step
            # k-1 has read its own, i.e. has finished, or has passed its last KV-cache read (model.step_tail)
            if go and tail is not None:
                tail.synchronize()
            else:
                got = fetcher.pop()[0]
        if go:
            if draw.prepare is not None:
                draw.prepare()
            following = draw.sample(model.decode_fed_back(seq_id, ids))
            fetcher.push(following)
            following_tail = model.step_tail
        if unread:
            if got is None:
                got = fetcher.pop()[0]
            if not on_token(got):
                fetcher.forget()   # the step queued behind the last token is wasted
                return
        if not go:
            return
        ids, unread, tail = following, True, following_tail

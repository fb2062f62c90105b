"""The runtime side of the CUDA batch-1 decode fast path: the library's `decode_graph` (one CUDA graph per step,
built where the compile option `decode_graph` is on, compiler/graph_decode.py), its paged-attention callback and
step-tail event, and the pipelined decode loop that feeds sampled ids back on the device.

decode_graph replays the attention through a name RewriteCUDAGraph captures (artifact.GRAPH_ATTENTION), registered
here before a library is loaded. Its graphs are keyed by the KV cache they were captured with and by the layout of
that cache's per-step metadata (decode_layout: where its arrays sit, which moves with the page table's size and, for
models with sliding-window layers, with the size of those layers' page table), so it serves sequences that span one
block of pages: added to the cache, never forked.

Pipelined decode: a synchronous step leaves the GPU idle while the host reads the sampled id, hands it out
(detokenize, stop checks, stream it), copies it back and launches the next step. Here step k is launched with step
k-1's sampled id still on the device, and step k-1's id is handed out while step k runs. What cannot overlap is
TVM's KV-cache metadata copy: BeginForward's arrays go to the device on a separate stream into one buffer, so step
k's may only be queued once step k-1 has read its own. With decode_graph that is once step k-1 has passed its last
attention (the step tail: an event recorded inside the graph; on an H200 this gains 5% on the 8B q4f16_1 decode and
2.5% on q0f16 over waiting for the whole step), else once step k-1 has finished. A draw that needs step k-1's
token (a grammar mask, DeviceDraw.after_token) is queued after that token is handed out, while step k's model
still runs: the host's share (the id read, the mask) overlaps the device's. When a token ends the request, the
step queued behind it is wasted; its KV entry belongs to a sequence the caller removes. Greedy tokens are the same
as the synchronous loop's (tests/test_engine.py, and tests/test_cuda_kernels.py on a GPU).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Sequence

from mlcc import artifact
from mlcc.runtime.core.sampler import DeviceDraw
from mlcc.runtime.device.interface import Function, KVCacheOps
from mlcc.runtime.device.token_fetch import CudaEvent, TokenFetcher, cuda_runtime

# The step tails the graph-attention callback records: id(GraphDecode) -> (kv cache, last layer, event, device).
# A process-wide table because TVM calls one registered function for every library loaded in the process.
_STEP_TAILS: dict[int, tuple[Any, int, CudaEvent, Any]] = {}
_CACHE_IDS = itertools.count(1)   # numbers each KV cache: a graph replays the addresses of the cache it was captured with


def register_graph_attention() -> None:
    """The paged-attention call of decode_graph: TVM's builtin under the name RewriteCUDAGraph captures, plus the
    graph key it ignores. Python runs here only on a layout's first step and its capture; replays skip the host.
    Must run before a VM resolves the library's external calls."""
    import tvm
    import tvm_ffi

    builtin = tvm.get_global_func("vm.builtin.attention_kv_cache_attention_with_fused_qkv")

    def attention(kv_cache, layer_id, sm_scale, qkv, _cache_id, _layout, out) -> None:
        builtin(kv_cache, layer_id, sm_scale, qkv, out)
        for kv, last, event, dev in list(_STEP_TAILS.values()):
            if layer_id == last and kv.same_as(kv_cache):
                event.record(tvm_ffi.get_raw_stream(dev), in_graph=True)  # every replay records it

    tvm_ffi.register_global_func(artifact.GRAPH_ATTENTION, attention, override=True)


def decode_layout(seq_len_after_step: int, page_size: int, sliding_window: int = 0) -> int:
    """The graph key of a step: artifact.graph_decode_layout of the page table and, where layers slide, of their
    own page table too, which TVM's metadata buffer holds right after it (the last pages of the sequence that the
    window reaches: window / page_size or one more, by where the window starts in its first page)."""
    key = artifact.graph_decode_layout(seq_len_after_step, page_size)
    if not sliding_window:
        return key
    pages = -(-seq_len_after_step // page_size)
    start = (seq_len_after_step - sliding_window) % page_size if seq_len_after_step > sliding_window else 0
    window_pages = min(pages, -(-(start + min(seq_len_after_step, sliding_window)) // page_size))
    return key << 20 | artifact.graph_decode_layout(window_pages * page_size, page_size)


class GraphDecode:
    """One loaded library's decode_graph and the sequences of its current KV cache that it may serve."""

    def __init__(self, fn: Function, kv_ops: KVCacheOps, shape: Callable, params: Any, dev: Any,
                 num_layers: int | None, sliding_window: int = 0):
        self.fn, self.kv_ops, self._shape, self.params, self.dev = fn, kv_ops, shape, params, dev
        self.sliding_window = sliding_window
        self.kv: Any = None
        self.page_size = 16
        self.cache_id = 0
        self.seq_len: dict[int, int] = {}
        # tail: recorded right after the step's last KV-cache read (the last layer's attention), so the pipelined
        # loop may queue the next step's KV metadata while the rest of this step (last MLP, LM head, sampling) runs
        cuda = cuda_runtime()
        self.tail = CudaEvent(cuda) if cuda is not None and num_layers else None
        self._last_layer = int(num_layers or 0) - 1
        if self.tail is not None:
            weakref.finalize(self, _STEP_TAILS.pop, id(self), None)

    def attach(self, kv: Any, page_size: int) -> None:
        """A new KV cache: none of its sequences has a graph yet. Registers the step tail before any capture."""
        self.kv, self.page_size, self.cache_id, self.seq_len = kv, page_size, next(_CACHE_IDS), {}
        if self.tail is not None:
            _STEP_TAILS[id(self)] = (kv, self._last_layer, self.tail, self.dev)

    def add(self, seq_id: int) -> None:
        self.seq_len[seq_id] = 0

    def forget(self, seq_id: int) -> None:
        """Removed, or forked (a fork's pages span more than one block)."""
        self.seq_len.pop(seq_id, None)

    def grow(self, seq_ids: Sequence[int], lens: Sequence[int]) -> None:
        for s, n in zip(seq_ids, lens):
            if s in self.seq_len:
                self.seq_len[s] += n

    def serves(self, seq_id: int) -> bool:
        return seq_id in self.seq_len

    def __call__(self, seq_id: int, ids: Any) -> Any:
        """One step of `seq_id`, already begun (begin_forward), its token id already on the device."""
        self.kv_ops.query_positions(self.kv)  # the graph's kernels read this step's metadata from the device
        layout = decode_layout(self.seq_len[seq_id] + 1, self.page_size, self.sliding_window)
        return self.fn(ids, self._shape([self.cache_id, layout]), self.kv, self.params)


def decode_pipelined(model, seq_id: int, token: int, draw: DeviceDraw, fetcher: TokenFetcher,
                     want_more: Callable[[int], bool], on_token: Callable[[int], bool]) -> None:
    """Decode `seq_id` from `token` (its last sampled id, already handed out) until told to stop.

    model: a LoadedModel (ids_to_device, decode_fed_back). draw: the next id from the logits, left on the device
    (Sampler.device_draw). want_more(in_flight) -> whether one more step may be queued while `in_flight` (0 or 1)
    steps' ids are still unread. on_token(id) -> whether the request is still live.
    Every queued step's id reaches on_token unless an earlier one ended the request."""
    ids = model.ids_to_device([token])
    unread, tail = False, None
    while True:
        go = want_more(1 if unread else 0)
        got = None
        if unread:
            # step k's KV-cache metadata goes into the buffer step k-1 reads: queue it once step k-1 has passed its
            # last KV-cache read (its tail), else read step k-1's id first, which waits for all of step k-1
            if go and tail is not None:
                tail.synchronize()
            else:
                got = fetcher.pop()[0]
        if go:
            if draw.prepare is not None:
                draw.prepare()
            logits, following_tail = model.decode_fed_back(seq_id, ids)
            if draw.after_token and unread:
                # the draw needs step k-1's token (a grammar's mask): hand it out while step k's model runs
                if got is None:
                    got = fetcher.pop()[0]
                if not on_token(got):
                    return   # step k is wasted, as below; its id is never drawn
                unread = False
            following = draw.sample(logits)
            fetcher.push(following)
        if unread:
            if got is None:
                got = fetcher.pop()[0]
            if not on_token(got):
                fetcher.forget()   # the step queued behind the last token is wasted
                return
        if not go:
            return
        ids, unread, tail = following, True, following_tail

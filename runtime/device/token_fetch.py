"""Sampled token ids from the device to the host without waiting for the kernels queued after them.

Pipelined decode (runtime.device.graph_decode) queues step k before it reads step k-1's token. Every read TVM offers
synchronizes the whole stream (`Tensor.numpy()` ends in a stream sync), which would wait for step k as well, and
TVM's Python API has no events. On CUDA the copy and the wait therefore go through the CUDA runtime TVM has already
loaded (libcudart): an asynchronous copy into page-locked memory on the stream TVM launches on, then an event
recorded behind it; waiting on that event waits for step k-1 and its copy only. Other devices read with a plain
`numpy()` (correct, no overlap).
"""

from __future__ import annotations

import collections
import ctypes
import logging
from typing import Any

log = logging.getLogger(__name__)

_CUDA = 2                              # DLDeviceType.kDLCUDA
_MEMCPY_DEVICE_TO_HOST = 2             # cudaMemcpyDeviceToHost
_EVENT_DISABLE_TIMING = 2              # cudaEventDisableTiming
_EVENT_RECORD_EXTERNAL = 1             # cudaEventRecordExternal
_STREAM_CAPTURE_ACTIVE = 1             # cudaStreamCaptureStatusActive
_LEGACY_STREAM = 0                     # TVM launches kernels and CUDA graphs on the default stream


def _loaded_cudart() -> ctypes.CDLL:
    """The libcudart TVM's CUDA runtime loaded (one runtime per process: events and streams must be its own)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("libcudart is not loaded: TVM's CUDA runtime must be loaded before the token fetcher")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


class _CudaRuntime:
    def __init__(self) -> None:
        self.lib = _loaded_cudart()

    def __call__(self, name: str, *args: Any) -> None:
        err = getattr(self.lib, name)(*args)
        if err != 0:
            msg = self.lib.cudaGetErrorString(err).decode()
            raise RuntimeError(f"{name} failed: {msg} (CUDA error {err})")


_RUNTIME: list = []


def cuda_runtime() -> _CudaRuntime | None:
    """The loaded CUDA runtime, or None where it cannot be reached (logged once)."""
    if not _RUNTIME:
        try:
            _RUNTIME.append(_CudaRuntime())
        except (OSError, RuntimeError, AttributeError) as e:
            log.warning("CUDA runtime not reachable from Python: %s", e)
            _RUNTIME.append(None)
    return _RUNTIME[0]


class CudaEvent:
    """A CUDA event (no timing) recorded on a raw stream handle; synchronize() waits for its latest record."""

    def __init__(self, cuda: _CudaRuntime):
        self._cuda, self.handle = cuda, ctypes.c_void_p()
        cuda("cudaEventCreateWithFlags", ctypes.byref(self.handle), ctypes.c_uint(_EVENT_DISABLE_TIMING))

    def record(self, stream: int, in_graph: bool = False) -> None:
        """in_graph: the record may happen under stream capture, where it must become a node every replay runs (a
        plain record there only orders the captured work, and synchronize() on it fails); the external flag is
        refused outside capture (H200: CUDA error 401), so the stream's capture state decides."""
        status = ctypes.c_int(0)
        if in_graph:
            self._cuda("cudaStreamIsCapturing", ctypes.c_void_p(stream), ctypes.byref(status))
        if status.value == _STREAM_CAPTURE_ACTIVE:
            self._cuda("cudaEventRecordWithFlags", self.handle, ctypes.c_void_p(stream),
                       ctypes.c_uint(_EVENT_RECORD_EXTERNAL))
        else:
            self._cuda("cudaEventRecord", self.handle, ctypes.c_void_p(stream))

    def synchronize(self) -> None:
        self._cuda("cudaEventSynchronize", self.handle)

    def __del__(self) -> None:
        try:
            self._cuda("cudaEventDestroy", self.handle)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the CUDA runtime may be gone
            pass


class TokenFetcher:
    """push(ids) queues a copy of a device int32 tensor of token ids (behind everything queued so far); pop() returns
    the oldest pushed ids as a list, waiting only for the kernels queued before its push."""

    def __init__(self, dev, max_ids: int = 64, slots: int = 4):
        self.dev = dev
        self.max_ids = max_ids
        self._queue: collections.deque = collections.deque()
        self._cuda = None
        self._slots: list = []   # page-locked host buffers, one per copy in flight, each with its event
        self._events: list = []
        self._next = 0
        if int(dev.dlpack_device_type()) == _CUDA:
            self._cuda = cuda_runtime()
            try:
                if self._cuda is not None:
                    self._cuda("cudaSetDevice", ctypes.c_int(dev.index))
                    for _ in range(slots):
                        host = ctypes.c_void_p()
                        self._cuda("cudaMallocHost", ctypes.byref(host), ctypes.c_size_t(4 * max_ids))
                        self._slots.append(host)
                    self._events = [CudaEvent(self._cuda) for _ in range(slots)]
            except RuntimeError as e:
                # still correct, only without the overlap: every read then waits for all queued work
                log.warning("sampled ids will be read synchronously (no CUDA event path): %s", e)
                self.close()

    @property
    def overlaps(self) -> bool:
        """Whether pop() leaves the kernels queued after the push running (CUDA), or waits for all of them."""
        return self._cuda is not None

    def push(self, ids) -> None:
        n = 1
        for d in ids.shape:
            n *= int(d)
        if str(ids.dtype) != "int32" or n > self.max_ids:
            raise ValueError(f"token ids must be int32 and at most {self.max_ids} of them, got {ids.dtype} {ids.shape}")
        if self._cuda is None:
            self._queue.append((ids, n, None))
            return
        if len(self._queue) >= len(self._slots):
            raise RuntimeError(f"more than {len(self._slots)} token copies in flight; pop() before pushing more")
        host, event = self._slots[self._next], self._events[self._next]
        self._next = (self._next + 1) % len(self._slots)
        self._cuda("cudaMemcpyAsync", host, ctypes.c_void_p(ids.data_ptr()), ctypes.c_size_t(4 * n),
                   ctypes.c_int(_MEMCPY_DEVICE_TO_HOST), ctypes.c_void_p(_LEGACY_STREAM))
        event.record(_LEGACY_STREAM)
        # keep the device tensor alive until its copy has run: the VM's allocator may hand its memory on otherwise
        self._queue.append((ids, n, (host, event)))

    def pop(self) -> list[int]:
        ids, n, slot = self._queue.popleft()
        if slot is None:
            return [int(t) for t in ids.numpy().reshape(-1)]
        host, event = slot
        event.synchronize()
        return list((ctypes.c_int32 * n).from_address(host.value))

    def forget(self) -> None:
        """Drop the copies not popped yet. Safe without waiting: a slot's next copy and any reuse of the device
        tensors' memory are queued on the same stream, behind them."""
        self._queue.clear()

    def close(self) -> None:
        if self._cuda is None:
            return
        self._queue.clear()
        cuda, self._cuda, slots, self._slots, self._events = self._cuda, None, self._slots, [], []
        for host in slots:
            cuda("cudaFreeHost", host)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the CUDA runtime may be gone
            pass



_MEMCPY_HOST_TO_DEVICE = 1             # cudaMemcpyHostToDevice


class UploadBuffer:
    """A device tensor that host arrays of one shape and dtype are copied into, step after step (a grammar mask,
    sampling parameters). On CUDA the copy is asynchronous, from page-locked memory, on the stream TVM launches on:
    the host does not wait for the kernels queued before it (those still reading the previous contents run first),
    so a pipelined step's upload does not stall the queue. Elsewhere a plain (synchronous) copyfrom."""

    def __init__(self, dev, shape: tuple[int, ...], dtype: str):
        import numpy as np
        import tvm

        self.tensor = tvm.runtime.empty(shape, dtype, dev)
        self._cuda = cuda_runtime() if int(dev.dlpack_device_type()) == _CUDA else None
        self._host = None
        if self._cuda is None:
            return
        self._nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
        host = ctypes.c_void_p()
        self._cuda("cudaMallocHost", ctypes.byref(host), ctypes.c_size_t(self._nbytes))
        self._host = host
        raw = (ctypes.c_ubyte * self._nbytes).from_address(host.value)
        self._view = np.frombuffer(raw, np.uint8)[: int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype)
        self._view = self._view.reshape(shape)
        self._event = CudaEvent(self._cuda)
        self._pending = False

    def upload(self, a) -> Any:
        if self._host is None:
            self.tensor.copyfrom(a)
            return self.tensor
        if self._pending:   # the previous copy must have read the staging memory before it is overwritten
            self._event.synchronize()
        self._view[...] = a
        self._cuda("cudaMemcpyAsync", ctypes.c_void_p(self.tensor.data_ptr()), self._host,
                   ctypes.c_size_t(self._nbytes), ctypes.c_int(_MEMCPY_HOST_TO_DEVICE), ctypes.c_void_p(_LEGACY_STREAM))
        self._event.record(_LEGACY_STREAM)
        self._pending = True
        return self.tensor

    def __del__(self) -> None:
        try:
            if self._host is not None:
                self._event.synchronize()
                self._cuda("cudaFreeHost", self._host)
                self._host = None
        except Exception:  # noqa: BLE001 - interpreter shutdown: the CUDA runtime may be gone
            pass

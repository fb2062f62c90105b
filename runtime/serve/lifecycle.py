"""What the HTTP server admits, and how its requests end other than by finishing.

The server is serving, draining (SIGTERM: running requests get a grace period, new ones a 503, then whatever is
still running is aborted), or failed (an engine step raised: the device may be in any state, so the server reports
unhealthy and refuses what it could never serve, for an orchestrator to restart it). A request also ends when its
client goes away: streamed or not, its generation is aborted rather than run to max_tokens for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import uvicorn

log = logging.getLogger(__name__)

T = TypeVar("T")
POLL_SECONDS = 0.2   # between receives that brought something other than the disconnect


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


class ShuttingDown(Exception):
    """The drain's grace period ran out with this request still running."""


class Lifecycle:
    """The server's admission state. `failure()` names an engine failure (None: healthy); `grace_seconds` is how
    long a drain waits for running requests before aborting them."""

    def __init__(self, grace_seconds: float = 30.0, failure: Callable[[], BaseException | None] = lambda: None):
        self.grace_seconds = grace_seconds
        self.failure = failure
        self.draining = False
        self.in_flight = 0
        self._stop: asyncio.Event | None = None

    @property
    def stop(self) -> asyncio.Event:
        """Set when the drain gives up on the requests still running (made on the server's event loop)."""
        if self._stop is None:
            self._stop = asyncio.Event()
        return self._stop

    def health(self) -> tuple[int, dict[str, Any]]:
        """/health's status code and body: 503 once failed or draining, so load balancers stop sending here."""
        failed = self.failure()
        if failed is not None:
            return 503, {"status": "unhealthy", "reason": f"engine failed: {describe(failed)}; restart the server"}
        if self.draining:
            return 503, {"status": "draining"}
        return 200, {"status": "ok"}

    def refusal(self, method: str, path: str) -> str | None:
        """Why a request is refused (None: admitted). A failed server refuses all but /health and /metrics; a
        draining one refuses new generation requests (POSTs)."""
        if path in ("/health", "/metrics"):
            return None
        failed = self.failure()
        if failed is not None:
            return (f"the engine failed ({describe(failed)}) and cannot serve requests; the server must be "
                    "restarted")
        if self.draining and method == "POST":
            return "the server is shutting down and admits no new requests; retry on another server"
        return None

    async def run(self, work: Awaitable[T], receive: Callable[[], Awaitable[dict[str, Any]]]) -> T:
        """`work`'s result, unless its client disconnects first (ClientGone) or the drain aborts it (ShuttingDown);
        either way `work` is cancelled, which aborts its generation."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_wait_disconnected(receive))
        stop = asyncio.ensure_future(self.stop.wait())
        self.in_flight += 1
        try:
            await asyncio.wait({task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise ClientGone() if gone.done() else self._shut_down()
        finally:
            self.in_flight -= 1
            for t in (task, gone, stop):
                t.cancel()

    async def stream(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """`items` until they end, or until the drain aborts them (ShuttingDown, after cancelling the pending
        item: that aborts the generation). Disconnects are the caller's to see: its send fails."""
        stop = asyncio.ensure_future(self.stop.wait())
        nxt: asyncio.Future | None = None
        self.in_flight += 1
        try:
            while True:
                nxt = asyncio.ensure_future(items.__anext__())
                await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    raise self._shut_down()
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            self.in_flight -= 1
            stop.cancel()
            if nxt is not None and not nxt.done():   # ends `items` (aborting its generation) before anyone closes it
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)

    def _shut_down(self) -> ShuttingDown:
        return ShuttingDown(f"the server shut down: this request was still running after the "
                            f"{self.grace_seconds:g} s grace period and was aborted; retry it")

    async def drain(self) -> None:
        """Refuse new requests, wait up to the grace period for the running ones, then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + self.grace_seconds
        log.info("draining: %d request(s) running, up to %.0f s to finish", self.in_flight, self.grace_seconds)
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("grace period of %.0f s over: aborting %d running request(s)", self.grace_seconds,
                        self.in_flight)
            self.stop.set()
            end = time.monotonic() + 5   # their error responses go out before the server closes
            while self.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)


async def _wait_disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    # a blocking receive: Request.is_disconnected's instant poll never sees the disconnect through Starlette's
    # BaseHTTPMiddleware (the server's guard); once the body is read, what comes next is the disconnect
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(POLL_SECONDS)


def describe(e: BaseException) -> str:
    """An exception as one line: its type and message."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM or SIGINT drains (`Lifecycle.drain`) before the usual shutdown; a second
    signal exits at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.lifecycle.draining or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            self.force_exit = self.lifecycle.draining
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)   # uvicorn re-raises it on the way out, as for its own shutdown
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        await self.lifecycle.drain()
        self.should_exit = True

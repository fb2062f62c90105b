"""An HTTP request carried from the Ray Serve ingress to an engine replica, and run there through mlcc's own FastAPI
app (runtime.serve.server.create_app) in-process: every endpoint, its checks, errors and streaming stay that app's.

The replica yields the response as it is sent: first {"status", "headers"}, then body chunks. When the caller goes
away (Ray Serve cancels the call), the app sees its client disconnect, which aborts the request's generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any


@dataclasses.dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    # the start of its prompt (runtime.serve.rayserve.prefix_index.prompt_text): what the router routes by
    prefix: str = ""


async def run_asgi(app: Any, req: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]:
    """The response of `app` to `req`: the start message as {"status", "headers"}, then the body's chunks."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
             "root_path": "", "query_string": req.query_string, "headers": req.headers,
             "client": ("ray-serve-ingress", 0), "server": ("mlcc-replica", 0)}
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    body_read = False
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": list(message.get("headers", []))}
            elif message["type"] == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
        task.result()   # the app's own crash, if any (it answers errors itself: rare)
    finally:
        gone.set()   # the caller left (or the response is complete): the app sees its client disconnect
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()

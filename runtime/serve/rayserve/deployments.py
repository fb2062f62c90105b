"""The Ray Serve application of `mlcc serve --ray`: an HTTP ingress (FastAPI behind `@serve.ingress`) in front of N
engine replicas, each an Engine serving mlcc's own FastAPI app.

The ingress reads each request's body, notes the start of its prompt and forwards the request, through the
prefix-affinity router (runtime.serve.rayserve.router), to an engine replica, which answers it with create_app's
app in-process (runtime.serve.rayserve.forwarding); the response streams back as the replica sends it. A replica
that dies before the first body byte has been passed on (a non-streamed response is all sent at its end) gets the
request retried on another; one that dies mid-stream ends the stream with an error event. /metrics at the ingress
is the router's (decisions, prefix hit rate, load and prefix-cache numbers per replica); each replica's own engine
metrics stay with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from mlcc.options import EngineConfig
from mlcc.runtime.serve.rayserve.forwarding import ForwardedRequest, run_asgi
from mlcc.runtime.serve.rayserve.prefix_index import prompt_text

log = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "MlccEngine"
MAX_ATTEMPTS = 3   # a request whose replica died before answering is tried on this many replicas in all


@dataclasses.dataclass(frozen=True)
class RayServeSettings:
    """How the engine deployment is laid out: `replicas` fixed, or autoscaled between min_replicas and
    max_replicas towards target_ongoing_requests per replica when max_replicas is set."""
    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int | None = None   # None: 4x the engine's max batch
    shutdown_grace_seconds: float = 30.0
    routing_stats_period_s: float = 2.0
    router_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def deployment_options(self, config: EngineConfig) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "name": ENGINE_DEPLOYMENT,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests or 4 * config.max_batch,
            "graceful_shutdown_timeout_s": self.shutdown_grace_seconds,
            "health_check_period_s": 5,
            "request_router_config": RequestRouterConfig(
                request_router_class="mlcc.runtime.serve.rayserve.router:PrefixAffinityRouter",
                request_router_kwargs=self.router_kwargs,
                request_routing_stats_period_s=self.routing_stats_period_s),
        }
        if self.max_replicas is not None:
            opts["autoscaling_config"] = AutoscalingConfig(
                min_replicas=self.min_replicas if self.min_replicas is not None else self.replicas,
                initial_replicas=self.replicas, max_replicas=self.max_replicas,
                target_ongoing_requests=self.target_ongoing_requests or config.max_batch)
        else:
            opts["num_replicas"] = self.replicas
        return opts


class EngineReplica:
    """One Engine and mlcc's FastAPI app over it. On a CPU it runs as many threads as the CPUs Ray gave it."""

    def __init__(self, model: str | None, config: EngineConfig, app_options: dict[str, Any], num_cpus: float):
        from mlcc.runtime.engine import Engine
        from mlcc.runtime.serve.server import create_app

        if config.num_threads is None and num_cpus >= 1:   # replicas share the host: no one takes every core
            config = dataclasses.replace(config, num_threads=int(num_cpus))
        self.engine = Engine(model, config=config)
        self.app = create_app(self.engine, **app_options)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        log.info("engine replica %s ready (pid %d)", self.replica_id, os.getpid())

    async def handle_http(self, req: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]:
        async for part in run_asgi(self.app, req):
            yield part

    def record_routing_stats(self) -> dict[str, Any]:
        core = self.engine.core
        stats = {"running": core.num_running(), "waiting": core.queue_length(),
                 "kv_pages_used": core.pages_in_use(), "kv_pages_total": core.total_pages, "pid": os.getpid()}
        cache = core.prefix_cache
        if cache is not None:
            stats.update(prefix_cache_hit_rate=cache.hit_rate(), prefix_cache_cached_tokens=cache.cached_tokens)
        return stats

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose engine failed (a device fault: it can serve nothing more)."""
        if self.engine.core.failure is not None:
            raise RuntimeError(f"engine failed: {self.engine.core.failure}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_ingress_app(engine: DeploymentHandle, api_key: str | None = None) -> FastAPI:
    """The ingress's FastAPI app: /metrics and /health here, every other request forwarded to an engine replica."""
    from mlcc.runtime.serve.rayserve.router_metrics import render_metrics

    app = FastAPI(title="mlcc (Ray Serve ingress)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics(request: Request):
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            return _error(401, "invalid or missing API key (Authorization: Bearer <key>)", "invalid_api_key",
                          etype="authentication_error")
        return Response(render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def forward(request: Request, path: str):
        body = await request.body()
        fwd = ForwardedRequest(request.method, request.url.path, request.url.query.encode(),
                               [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
                               body, prefix=_prefix(request.method, body))
        return await _forward(engine, fwd)

    return app


def _prefix(method: str, body: bytes) -> str:
    if method != "POST" or not body or len(body) > 4 << 20:
        return ""
    try:
        parsed = json.loads(body)
    except ValueError:
        return ""
    return prompt_text(parsed) if isinstance(parsed, dict) else ""


async def _forward(engine: DeploymentHandle, fwd: ForwardedRequest) -> Response:
    """The replica's response, retried on another replica where one died before any of its body went out."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        gen = engine.options(stream=True).handle_http.remote(fwd)
        try:
            start = await gen.__anext__()
            first = await anext(gen, b"")   # held back: a replica that dies before it can still be retried
        except RayActorError as e:
            gen.cancel()
            log.warning("engine replica died before answering (attempt %d of %d): %s", attempt, MAX_ATTEMPTS,
                        type(e).__name__)
            if attempt == MAX_ATTEMPTS:
                return _error(503, f"the engine replicas serving this request died ({type(e).__name__}) "
                                   f"{MAX_ATTEMPTS} times; retry later", "replica_died")
            continue
        except BaseException:
            gen.cancel()
            raise
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]
                   if k.lower() not in (b"content-length", b"transfer-encoding")}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_relay(gen, first, sse), status_code=start["status"], headers=headers)
    raise AssertionError("unreachable")


async def _relay(gen, first: bytes, sse: bool) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for chunk in gen:
            yield chunk
    except RayActorError as e:
        log.warning("engine replica died mid-response: %s", type(e).__name__)
        if sse:   # headers are out: report in-band, as the server does for its own failures
            message = f"the engine replica serving this stream died ({type(e).__name__}); retry the request"
            yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n".encode()
    finally:
        gen.cancel()   # the client left, or the response is complete: nothing more to generate


def _error(status: int, message: str, code: str, etype: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": None, "code": code}},
                        status_code=status)


def build_application(model: str | None, config: EngineConfig, settings: RayServeSettings,
                      api_key: str | None = None, served_name: str | None = None) -> Application:
    """The bound Ray Serve application: the ingress over `settings`'s engine replicas of `model`."""
    app_options = {"api_key": api_key, "served_name": served_name,
                   "shutdown_grace_seconds": settings.shutdown_grace_seconds}
    engine = serve.deployment(EngineReplica).options(**settings.deployment_options(config)).bind(
        model, config, app_options, settings.num_cpus)
    ingress = serve.deployment(name="MlccIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)(serve.ingress()(Ingress))
    return ingress.bind(engine, api_key)


class Ingress:
    """The HTTP ingress replica; its app is built once it holds the engine deployment's handle."""

    def __init__(self, engine: DeploymentHandle, api_key: str | None):
        self.engine, self.api_key = engine, api_key

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self.engine, self.api_key)

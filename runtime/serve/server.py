"""OpenAI-compatible HTTP server (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics;
with --allow-runtime-lora, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.

Bodies are read and validated by runtime.api.protocol (a depth-limited JSON parser, then the request models), not by
FastAPI, so every refusal is a 4xx in OpenAI's shape naming the field; unknown paths and wrong methods answer in
that shape too. The request models are also the OpenAPI document's request bodies.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from mlcc.errors import LoraAdapterError, RequestError
from mlcc.runtime.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    parse_load_lora_request,
    parse_unload_lora_request,
)
from mlcc.runtime.engine import AsyncEngine, Engine
from mlcc.runtime.engine_core import GenerationError
from mlcc.runtime.serve.lifecycle import ClientGone, Lifecycle, ShuttingDown

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
_STATUS_CODES = {"request_too_large": 413, "model_not_found": 404, "runtime_lora_disabled": 403}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           etype: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": param, "code": code}},
                        status_code=status, headers=headers)


class _Metrics:
    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mlcc_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("mlcc_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("mlcc_generation_tokens", "tokens generated", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("mlcc_time_to_first_token_seconds", "time to first token", buckets=buckets, registry=r)
        self.itl = Histogram("mlcc_inter_token_latency_seconds", "time between streamed tokens", buckets=buckets,
                             registry=r)
        self.aborted = Counter("mlcc_requests_aborted", "requests aborted by client disconnect", registry=r)
        core = engine.core
        Gauge("mlcc_kv_pages_used", "KV cache pages in use", registry=r).set_function(core.pages_in_use)
        Gauge("mlcc_kv_pages_free", "KV cache pages free", registry=r).set_function(core.free_pages)
        Gauge("mlcc_kv_pages_total", "KV cache pages", registry=r).set_function(lambda: core.total_pages)
        Gauge("mlcc_queue_length", "requests waiting for admission", registry=r).set_function(core.queue_length)
        Gauge("mlcc_running_requests", "requests in the running batch", registry=r).set_function(core.num_running)
        Gauge("mlcc_requests_preempted", "times a running request gave its KV pages back, to be recomputed later",
              registry=r).set_function(lambda: core.stats["preempted"])
        Gauge("mlcc_prefix_cache_pages", "KV cache pages only the prefix cache holds (evicted when needed)",
              registry=r).set_function(core.cached_pages)
        spec = core.speculator
        if spec is not None:   # vLLM's spec_decode counters, and the two ratios
            for name, key, doc in (("num_drafts", "spec_drafts", "verify steps of speculating requests"),
                                   ("num_draft_tokens", "spec_draft_tokens", "tokens proposed"),
                                   ("num_accepted_tokens", "spec_accepted_tokens", "proposed tokens accepted"),
                                   ("num_emitted_tokens", "spec_emitted_tokens", "tokens speculating steps emitted")):
                Gauge(f"mlcc_spec_decode_{name}", doc, registry=r).set_function(lambda k=key: core.stats[k])
            Gauge("mlcc_spec_decode_acceptance_rate", "proposed tokens accepted, of all proposed",
                  registry=r).set_function(spec.acceptance_rate)
            Gauge("mlcc_spec_decode_mean_tokens_per_step", "tokens a speculating request emits per verify step",
                  registry=r).set_function(spec.mean_tokens_per_step)
        pool = engine.model.lora
        if pool is not None:
            Gauge("mlcc_lora_adapters", "LoRA adapters served", registry=r).set_function(
                lambda: len(engine.lora_adapters))
            Gauge("mlcc_lora_slots", "adapters the device pool holds at once", registry=r).set(pool.capacity)
            Gauge("mlcc_lora_slot_loads", "adapters written into a pool slot (a miss of the pool)",
                  registry=r).set_function(lambda: pool.loads)
        cache = core.prefix_cache
        if cache is not None:
            Gauge("mlcc_prefix_cache_hit_rate", "prompt tokens served from the prefix cache, of all prompt tokens",
                  registry=r).set_function(cache.hit_rate)
            Gauge("mlcc_prefix_cache_cached_tokens", "prompt tokens served from the prefix cache",
                  registry=r).set_function(lambda: cache.cached_tokens)
            Gauge("mlcc_prefix_cache_hits", "requests that reused a cached prefix",
                  registry=r).set_function(lambda: cache.hits)
            Gauge("mlcc_prefix_cache_queries", "requests looked up in the prefix cache",
                  registry=r).set_function(lambda: cache.queries)
            Gauge("mlcc_prefix_cache_entries", "cached sequences", registry=r).set_function(lambda: cache.num_entries)
            Gauge("mlcc_prefix_cache_evictions", "cached sequences evicted for pages",
                  registry=r).set_function(lambda: cache.evictions)


def create_app(engine: Engine, api_key: str | None = None, served_name: str | None = None,
               allow_runtime_lora: bool = False, shutdown_grace_seconds: float = 30.0) -> FastAPI:
    """allow_runtime_lora: answer /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING); the adapters given at start are served either way.
    shutdown_grace_seconds: how long a drain (app.state.lifecycle, runtime.serve.lifecycle) lets running requests
    finish."""
    aengine = AsyncEngine(engine)
    name = served_name or engine.model_name
    # a vision-language model's requests carry their images base64-encoded (4/3 of their bytes)
    body_limit = MAX_BODY_BYTES + (engine.config.max_images_per_request * engine.config.max_image_bytes * 4 // 3
                                   if engine.vision else 0)
    metrics = _Metrics(engine)
    lifecycle = Lifecycle(shutdown_grace_seconds, failure=lambda: engine.core.failure)
    app = FastAPI(title="mlcc", version="1")

    def endpoint_label(request: Request) -> str:
        # the route's path, or one label for every unknown path (a label per path would let a client grow the
        # metrics without bound)
        route = request.scope.get("route")
        return getattr(route, "path", None) or (request.url.path if request.url.path in known else "unmatched")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key and request.url.path != "/health" and \
                request.headers.get("authorization", "") != f"Bearer {api_key}":
            metrics.requests.labels(endpoint_label(request), "401").inc()
            return _error(401, "invalid or missing API key (Authorization: Bearer <key>)",
                          etype="authentication_error", code="invalid_api_key")
        refusal = lifecycle.refusal(request.method, request.url.path)
        if refusal is not None:
            metrics.requests.labels(endpoint_label(request), "503").inc()
            return _error(503, refusal, etype="server_error", code="service_unavailable")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > body_limit:
            metrics.requests.labels(endpoint_label(request), "413").inc()
            return _too_large(body_limit)
        response = await call_next(request)
        metrics.requests.labels(endpoint_label(request), str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestError)
    async def on_request_error(_request: Request, e: RequestError):
        return _error(_STATUS_CODES.get(e.code, 400), str(e), param=e.param, code=e.code)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):
        if e.status_code == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "unknown_url"
        elif e.status_code == 405:
            message, code = f"Method {request.method} is not allowed for {request.url.path}", "method_not_allowed"
        else:
            message, code = str(e.detail), None
        return _error(e.status_code, message, code=code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, e: RequestValidationError):   # path parameters only
        return _error(400, f"invalid request: {e.errors()[0].get('msg')}", code="invalid_value")

    @app.exception_handler(GenerationError)
    async def on_generation_error(_request: Request, e: GenerationError):   # the engine failed: /health says so
        return _error(500, str(e), etype="server_error", code="engine_failed")

    @app.exception_handler(Exception)
    async def on_crash(_request: Request, e: Exception):
        log.exception("request failed")
        return _error(500, f"internal error: {type(e).__name__}", etype="server_error")

    async def read_body(request: Request) -> dict[str, Any]:
        chunks, size = [], 0
        async for chunk in request.stream():   # a chunked body has no content-length: count as it arrives
            size += len(chunk)
            if size > body_limit:
                raise RequestError(f"request body over {body_limit} bytes", code="request_too_large")
            chunks.append(chunk)
        # a megabyte-sized body takes a few hundred milliseconds to check: off the event loop, which streams
        return await run_in_threadpool(parse_json_body, b"".join(chunks))

    async def handle(request: Request, parse: Callable[[dict[str, Any]], BaseModel], api):
        req = parse(await read_body(request))
        if req.model is not None and req.model != name and req.model not in engine.lora_adapters:
            raise RequestError(f"The model '{req.model[:200]}' does not exist; this server serves "
                               f"{', '.join(repr(m) for m in served_models())}", param="model", code="model_not_found")
        fields = req.model_dump(exclude_unset=True, by_alias=True)
        fields.pop("model", None)
        stream = bool(fields.pop("stream", False))
        t0 = time.perf_counter()
        # a LoRA adapter's name picks it (runtime.api.prepare), else the base model answers
        result = api.create(stream=stream, model=req.model if req.model in engine.lora_adapters else name, **fields)
        if stream:
            result = await result
        else:   # generated to the end unless its client goes away or the drain gives up on it
            try:
                result = await lifecycle.run(result, request.receive)
            except ClientGone:
                metrics.aborted.inc()
                return Response(status_code=499)   # nginx's "client closed request": nobody reads it
            except ShuttingDown as e:
                return _error(503, str(e), etype="server_error", code="service_unavailable")
            metrics.prompt_tokens.inc(result.usage.prompt_tokens)
            metrics.generation_tokens.inc(result.usage.completion_tokens)
            metrics.ttft.observe(time.perf_counter() - t0)
            return JSONResponse(result.model_dump(exclude_none=True))
        return StreamingResponse(_sse(request, result, t0), media_type="text/event-stream")

    async def _sse(request: Request, chunks: AsyncIterator[Any], t0: float) -> AsyncIterator[bytes]:
        last, done = None, False
        try:
            async for chunk in lifecycle.stream(chunks):
                now = time.perf_counter()
                if chunk.choices and _has_text(chunk):
                    metrics.generation_tokens.inc()
                    if last is None:
                        metrics.ttft.observe(now - t0)
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                if chunk.usage:
                    metrics.prompt_tokens.inc(chunk.usage.prompt_tokens)
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            done = True
        except Exception as e:  # headers are out; report in-band as OpenAI does
            log.exception("stream failed")
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n".encode()
            done = True
        finally:
            if not done:  # client went away: closing `chunks` aborts the request and frees its pages
                metrics.aborted.inc()
                await chunks.aclose()

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await handle(request, parse_chat_request, aengine.chat.completions)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await handle(request, parse_completion_request, aengine.completions)

    def served_models() -> list[str]:
        return [name, *engine.lora_adapters]

    def model_card(model: str) -> dict[str, Any]:
        adapter = engine.lora_adapters.get(model) if model != name else None
        if adapter is None:
            return {"id": name, "object": "model", "created": 0, "owned_by": "mlcc"}
        # vLLM's card of an adapter: its folder as root, the base model as parent
        return {"id": model, "object": "model", "created": 0, "owned_by": "mlcc", "root": str(adapter.path),
                "parent": name}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in served_models():
            raise RequestError(f"The model '{model[:200]}' does not exist; this server serves "
                               f"{', '.join(repr(m) for m in served_models())}", param="model", code="model_not_found")
        return model_card(model)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in served_models()]}

    def runtime_lora() -> None:
        if not allow_runtime_lora:
            raise RequestError("loading and unloading LoRA adapters at run time is off: start the server with "
                               "--allow-runtime-lora", code="runtime_lora_disabled")

    @app.post("/v1/load_lora_adapter", openapi_extra=_body_schema(LoadLoraAdapterRequest))
    async def load_lora_adapter(request: Request):
        runtime_lora()
        req = parse_load_lora_request(await read_body(request))
        if req.lora_name == name:
            raise RequestError(f"'{name}' is the base model's name; give the adapter another", param="lora_name")
        try:
            if req.load_inplace and req.lora_name in engine.lora_adapters:
                engine.unload_lora(req.lora_name)
            await run_in_threadpool(engine.load_lora, req.lora_name, req.lora_path)
        except LoraAdapterError as e:
            raise RequestError(str(e), param="lora_path", code="invalid_lora_adapter") from None
        log.info("LoRA adapter %r loaded from %s", req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(UnloadLoraAdapterRequest))
    async def unload_lora_adapter(request: Request):
        runtime_lora()
        req = parse_unload_lora_request(await read_body(request))
        try:
            engine.unload_lora(req.lora_name)
        except LoraAdapterError as e:
            raise RequestError(str(e), param="lora_name", code="model_not_found") from None
        log.info("LoRA adapter %r unloaded", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.get("/health")
    async def health():
        status, body = lifecycle.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    known = {getattr(r, "path", None) for r in app.routes}
    app.state.engine = engine
    app.state.lifecycle = lifecycle
    return app


def _too_large(limit: int) -> JSONResponse:
    return _error(413, f"request body over {limit} bytes", code="request_too_large")


def _has_text(chunk: Any) -> bool:
    c = chunk.choices[0]
    return bool(getattr(getattr(c, "delta", None), "content", None) or getattr(c, "text", None))


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:  # the OpenAPI document has no $defs section: inline the (non-recursive) refs
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            # a discriminator's mapping points into $defs; each member's const tag already tells them apart
            return {k: inline(v) for k, v in node.items() if k != "discriminator"}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}

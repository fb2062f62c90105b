"""OpenAI-compatible HTTP server (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

Bodies are parsed by hand so that every bad input becomes an OpenAI-shaped 4xx naming the field; the pydantic
models below only describe the API in the OpenAPI document.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from mlcc.errors import RequestError

from .engine import AsyncEngine, Engine

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class _Sampling(BaseModel):
    """The documented fields; fields OpenAI defines that we accept and ignore (user, logit_bias, …) are omitted."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    echo: bool | None = None


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           etype: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": param, "code": code}}, status_code=status)


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


def create_app(engine: Engine, api_key: str | None = None, served_name: str | None = None) -> FastAPI:
    aengine = AsyncEngine(engine)
    name = served_name or engine.model_name
    metrics = _Metrics(engine)
    app = FastAPI(title="mlcc", version="1")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        endpoint = request.url.path
        if api_key and endpoint != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                metrics.requests.labels(endpoint, "401").inc()
                return _error(401, "invalid or missing API key (Authorization: Bearer <key>)",
                              etype="authentication_error", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            metrics.requests.labels(endpoint, "413").inc()
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")
        response = await call_next(request)
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestError)
    async def on_request_error(_request: Request, e: RequestError):
        status = 400
        return _error(status, str(e), param=e.param, code=e.code)

    @app.exception_handler(Exception)
    async def on_crash(_request: Request, e: Exception):
        log.exception("request failed")
        return _error(500, f"internal error: {type(e).__name__}", etype="server_error")

    async def read_json(request: Request) -> dict[str, Any]:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"body is not valid JSON: {e}", code="invalid_json") from e
        if not isinstance(data, dict):
            raise RequestError("body must be a JSON object", code="invalid_json")
        model = data.pop("model", None)
        if model is not None and model != name:
            raise _ModelNotFound(model)
        for key, kind in (("stream", bool), ("stream_options", dict), ("echo", bool)):
            if data.get(key) is not None and not isinstance(data[key], kind):
                raise RequestError(f"{key} must be a {kind.__name__}", param=key)
        if data.get("stream_options") and not data.get("stream"):
            raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
        return data

    class _ModelNotFound(Exception):
        def __init__(self, model: Any):
            self.model = model

    @app.exception_handler(_ModelNotFound)
    async def on_model(_request: Request, e: _ModelNotFound):
        return _error(404, f"model '{e.model}' does not exist; this server serves '{name}'", param="model",
                      code="model_not_found")

    async def respond(request: Request, api, data: dict[str, Any]):
        stream = bool(data.pop("stream", False))
        t0 = time.perf_counter()
        result = await api.create(stream=stream, model=name, **data)
        if not stream:
            metrics.prompt_tokens.inc(result.usage.prompt_tokens)
            metrics.generation_tokens.inc(result.usage.completion_tokens)
            metrics.ttft.observe(time.perf_counter() - t0)
            return JSONResponse(result.model_dump(exclude_none=True))
        return StreamingResponse(_sse(request, result, t0), media_type="text/event-stream")

    async def _sse(request: Request, chunks: AsyncIterator[Any], t0: float) -> AsyncIterator[bytes]:
        last, done = None, False
        try:
            async for chunk in chunks:
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
        except Exception as e:  # noqa: BLE001 - headers are out; report in-band as OpenAI does
            log.exception("stream failed")
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n".encode()
            done = True
        finally:
            if not done:  # client went away: closing `chunks` aborts the request and frees its pages
                metrics.aborted.inc()
                await chunks.aclose()

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        data = await read_json(request)
        if "messages" not in data:
            raise RequestError("messages is required", param="messages")
        return await respond(request, aengine.chat.completions, data)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        data = await read_json(request)
        if "prompt" not in data:
            raise RequestError("prompt is required", param="prompt")
        return await respond(request, aengine.completions, data)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "mlcc"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    app.state.engine = engine
    return app


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
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}

"""The HTTP layer: OpenAI routes (and Ollama's, server/ollama_routes.py), auth, SSE framing, health and metrics.
No tensor code here."""

from __future__ import annotations

import asyncio
import base64
import struct
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.datastructures import Headers

from edgespec.server.dashboard import Dashboard, DashboardState
from edgespec.server.errors import OLLAMA_PREFIX, APIError, error_response, install_error_handlers
from edgespec.server.ollama_routes import ollama_router
from edgespec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    JoinRequest,
    SamplingFields,
)
from edgespec.server.render import Renderer
from edgespec.server.responses_protocol import ResponsesRequest, sampling_fields, to_chat_input
from edgespec.server.responses_render import ResponsesRenderer
from edgespec.server.responses_store import ResponseStore, conversation_after
from edgespec.server.service import CompletionService
from edgespec.server.streaming import collect, respond, response_events, started
from edgespec.workers.auth import any_bearer_ok, bearer_ok
from edgespec.workers.cluster import cluster_health
from edgespec.workers.counted_body import CountedBody


class _LimitsAndCounts:
    """Refuses bodies over max_request_bytes (by Content-Length, or counted as a chunked body arrives) and
    counts the API's requests (/v1 and Ollama's /api) by route template and status.

    Plain ASGI on purpose: an @app.middleware("http") (BaseHTTPMiddleware) wraps `receive` so that
    request.is_disconnected() never sees the client leave, and a non-streamed generation would run on.
    """

    def __init__(self, app, settings, metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        limit = self.settings.max_request_bytes

        def too_large(size: str) -> APIError:
            return APIError(413, f"request body of {size} bytes exceeds the limit of {limit}", None,
                            "body_too_large")

        body = CountedBody(receive, limit, lambda: too_large(f"more than {limit}"))

        async def send_counted(message):
            nonlocal status
            if body.exceeded:  # whatever the app made of the aborted body (FastAPI: a 400), the client gets a 413
                if message["type"] == "http.response.start":
                    status = 413
                    await error_response(too_large(f"more than {limit}"), scope["path"])(scope, receive, send)
                return
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        length = Headers(scope=scope).get("content-length")
        try:
            if length and length.isdigit() and int(length) > limit:
                await error_response(too_large(length), scope["path"])(scope, receive, send_counted)
            else:
                await self.app(scope, body.receive, send_counted)
        finally:
            if scope["path"].startswith(("/v1/", OLLAMA_PREFIX)):
                route = scope.get("route")  # the template, so that arbitrary paths make no new series
                self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()


def create_app(service: CompletionService, on_shutdown=None) -> FastAPI:
    """The controller's ASGI app around a ready CompletionService; on_shutdown() runs when it stops."""
    settings, metrics = service.settings, service.metrics

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        monitor = asyncio.create_task(service.cluster.monitor()) if service.cluster is not None else None
        try:
            yield
        finally:
            if monitor is not None:
                monitor.cancel()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="edgespec", summary="OpenAI-compatible inference across small devices", lifespan=lifespan)
    install_error_handlers(app)

    app.add_middleware(_LimitsAndCounts, settings=settings, metrics=metrics)
    stored = ResponseStore()  # finished Responses API conversations, for previous_response_id

    api_keys = settings.api_keys()

    async def require_key(request: Request) -> None:
        if api_keys and not any_bearer_ok(request.headers.get("authorization"), api_keys):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'", None,
                           "invalid_api_key")

    app.include_router(ollama_router(service, require_key))  # the Ollama API: server/ollama_routes.py

    @app.get("/health")
    async def health():
        if service.cluster is None:
            return {"status": "ok", "model": service.model_id}
        cluster = service.cluster
        # the list as it is now: a re-plan may replace the pipeline's workers while their health is awaited
        refs = list(cluster.pipeline.workers)
        workers = await cluster_health([w.url for w in refs], cluster.config.token)
        for w, ref in zip(workers, refs, strict=True):
            w.update(name=ref.name, layers=[ref.first, ref.last])
        ok = all(w.get("status") == "ok" and w.get("assigned") for w in workers)
        # workers planned out after a loss: the placement serves without them (200), but the cluster is short
        lost = [{"name": m.name, "url": m.url} for m in cluster.members.values() if not m.up]
        body = {"status": "ok" if ok and not lost else "degraded", "model": service.model_id, "workers": workers,
                "lost": lost}
        return JSONResponse(body, status_code=200 if ok else 503)

    def require_cluster_token(request: Request):
        cluster = service.cluster
        if cluster is None or not bearer_ok(request.headers.get("authorization"), cluster.config.token):
            raise APIError(401, "missing or wrong cluster token", None, "invalid_cluster_token")
        return cluster

    @app.post("/internal/cluster/join", status_code=202)
    async def join(body: JoinRequest, request: Request):
        require_cluster_token(request).request_join(body.url, body.name)
        return {"accepted": True}

    @app.get("/internal/cluster/plan")
    async def placement(request: Request):
        return require_cluster_token(request).plan.to_dict()

    @app.get("/metrics")
    async def prometheus():
        metrics.kv_bytes.set(service.engine.executor.kv_bytes())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # Like /health and /metrics, the dashboard asks for no API key: it is read-only and shows the same kind of
    # figures (placement, counts, timings), never a request's contents.
    dashboard = Dashboard(service)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard_page():
        """The live dashboard: one HTML page that polls /dashboard/state every second."""
        return HTMLResponse(dashboard.page(), headers={"cache-control": "no-store"})

    @app.get("/dashboard/state", response_model=DashboardState)
    async def dashboard_state():
        """The devices, placement, link traffic, requests, policies and re-plans, as the dashboard shows them."""
        return dashboard.state()

    def model_card() -> dict:
        return {"id": service.model_id, "object": "model", "created": 0, "owned_by": "edgespec",
                "context_length": service.context, "policies": sorted(service.policies)}

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(require_key)])
    async def get_model(name: str):
        service.check_model(name)
        return model_card()

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat(req: ChatCompletionRequest, request: Request):
        service.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        chat_input = req.chat_input()
        top = (req.top_logprobs or 0) if req.logprobs else None
        gen, reader = await service.chat_request(req, chat_input, req.max_completion_tokens or req.max_tokens,
                                                 req.logprobs, top or 0)
        renderer = Renderer("chat", service.model_id, service.tokenizer, len(gen.prompt_ids), top,
                            legacy=chat_input.legacy_functions)
        return await respond(service.deltas(gen, reader), renderer, req, request)

    @app.post("/v1/responses", dependencies=[Depends(require_key)])
    async def responses(req: ResponsesRequest, request: Request):
        service.check_model(req.model)
        history = stored.get(req.previous_response_id) if req.previous_response_id else ()
        chat_input = to_chat_input(req, history)
        fields = SamplingFields(**sampling_fields(req))
        gen, reader = await service.chat_request(fields, chat_input, fields.max_tokens, max_param="max_output_tokens")
        renderer = ResponsesRenderer(service.model_id, req, len(gen.prompt_ids))

        def keep() -> None:  # the conversation, for a continuation by previous_response_id
            if req.store:
                stored.put(renderer.id, conversation_after(chat_input, req.instructions, renderer.assistant_message()))

        deltas = await started(service.deltas(gen, reader))
        if req.stream:
            return EventSourceResponse(response_events(deltas, renderer, keep), sep="\n", ping=15)
        collected = await collect(deltas, request)
        if collected is None:
            return Response(status_code=499)
        body = renderer.response(collected)
        keep()
        return JSONResponse(body)

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(req: CompletionRequest, request: Request):
        service.check_model(req.model)
        prompt = service.completion_prompt(req)
        top = req.logprobs
        gen = service.generation_request(req, prompt, req.max_tokens, top is not None, top or 0, "prompt")
        echo = service.completion_echo(req) if req.echo else None
        renderer = Renderer("text", service.model_id, service.tokenizer, len(prompt), top, echo=echo)
        return await respond(service.deltas(gen, service.reader()), renderer, req, request)

    @app.post("/v1/embeddings", dependencies=[Depends(require_key)])
    async def embeddings(req: EmbeddingRequest):
        service.check_model(req.model)
        vectors, tokens = await service.embeddings(req)
        as_base64 = req.encoding_format == "base64"  # float32 little-endian bytes, as the OpenAI SDK decodes them
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if as_base64 else v}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": service.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app

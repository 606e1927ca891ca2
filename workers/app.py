"""The worker's HTTP API and its link endpoint. Every route needs the cluster token (/health without one answers
only that the worker is up). Errors are OpenAI-style error objects; an unexpected fault is a logged 500.

HTTP is for control: assignment, profiling, link probes, info and health. Forward calls and session operations,
and HeadSplit's per-step calls, travel on links, persistent WebSockets at /link (workers/relay.py,
workers/head_relay.py), whose handshake needs the token too.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import httpx
import torch
import websockets
from fastapi import Depends, FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgespec.workers.auth import bearer_ok, proof
from edgespec.workers.bodies import AssignBody, LinkBody, ProfileBody
from edgespec.workers.counted_body import CountedBody
from edgespec.workers.discovery import announced
from edgespec.workers.errors import ERRORS
from edgespec.workers.head_relay import HeadRelay
from edgespec.workers.head_routes import add_head_routes
from edgespec.workers.host import StageHost
from edgespec.workers.probe import measure_link
from edgespec.workers.relay import ws_url
from edgespec.workers.settings import WorkerSettings

log = logging.getLogger(__name__)


class BodyError(ValueError):
    """A request body past max_body_bytes, found while it arrives (answered 413)."""

    status = 413


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error object, as the controller's own errors are."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


async def _announce(client: httpx.AsyncClient, settings: WorkerSettings, join: str, name: str) -> None:
    """Tell the controller at `join` (--join) that this worker is here; retried until it answers."""
    url = settings.advertise_url or f"http://{settings.host}:{settings.port}"
    headers = {"authorization": f"Bearer {settings.token}"}
    for _ in range(60):
        await asyncio.sleep(1)  # uvicorn starts listening after the lifespan's start-up
        try:
            r = await client.post(join.rstrip("/") + "/internal/cluster/join", headers=headers,
                                  json={"url": url, "name": name})
            if r.status_code == 202:
                return
            log.warning("the controller at %s refused the join: %s %s", settings.join, r.status_code, r.text[:200])
            return
        except httpx.HTTPError:
            continue
    log.error("the controller at %s never answered; not joined", settings.join)


class _TokenAndLimits:
    """Refuses, before anything reads its body, a request without the cluster token (401; /health alone answers
    without it) and a body over max_body_bytes (413, by Content-Length or counted as it arrives): FastAPI parses
    a JSON body before the route's dependencies run, so the routes' own token check comes too late to spare the
    parsing. Plain ASGI, as the controller's _LimitsAndCounts, so that disconnects still reach the routes."""

    def __init__(self, app, settings: WorkerSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not bearer_ok(headers.get("authorization"), self.settings.token):
            await _error(401, "missing or wrong cluster token", "invalid_cluster_token")(scope, receive, send)
            return
        limit, length = self.settings.max_body_bytes, headers.get("content-length")
        too_large = _error(413, f"request bodies are limited to {limit} bytes", "body_too_large")
        if length and length.isdigit() and int(length) > limit:
            await too_large(scope, receive, send)
            return
        # answered below, whatever the app made of it
        body = CountedBody(receive, limit, lambda: BodyError(f"more than {limit} bytes"))

        async def send_checked(message):
            if not body.exceeded:
                await send(message)
            elif message["type"] == "http.response.start":
                await too_large(scope, receive, send)

        await self.app(scope, body.receive, send_checked)


def create_worker_app(settings: WorkerSettings) -> FastAPI:
    host = StageHost(settings)
    if settings.threads:
        torch.set_num_threads(settings.threads)

    relay = HeadRelay(host, settings)  # the layer pipeline's ops and HeadSplit's

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with httpx.AsyncClient(timeout=settings.downstream_timeout_s) as client, \
                announced(settings, host.name):  # DNS-SD on the LAN, for `serve --discover`
            announce = None
            if settings.join:
                announce = asyncio.create_task(_announce(client, settings, settings.join, host.name))
            yield
            if announce is not None:
                announce.cancel()
            await relay.close()

    app = FastAPI(title="edgespec worker", lifespan=lifespan)
    app.state.host, app.state.relay = host, relay
    app.add_middleware(_TokenAndLimits, settings=settings)

    async def require_token(request: Request) -> None:
        if not bearer_ok(request.headers.get("authorization"), settings.token):
            raise PermissionError("missing or wrong cluster token")

    for kind, status, code in ERRORS:
        # bind status now: one handler per exception class, matched along the exception's MRO
        app.add_exception_handler(kind, lambda _, exc, status=status, code=code: _error(status, str(exc), code))

    app.add_exception_handler(BodyError, lambda _, exc: _error(exc.status, str(exc), "invalid_body_length"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON", "invalid_json")
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), None)

    @app.exception_handler(Exception)  # Starlette's outermost middleware: never its plain-text page
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
        return _error(500, "the worker had an error while processing the request; it has been logged",
                      "internal_error")

    auth = [Depends(require_token)]
    add_head_routes(app, relay.heads, auth)

    @app.get("/health")
    async def health(request: Request):
        # Liveness for anyone (a probe without the token); the details, which identify the process and what it
        # holds, only with the cluster's token. A wrong token is refused, so that a misconfigured controller
        # learns it at once.
        authorization = request.headers.get("authorization")
        challenge = request.query_params.get("challenge")
        if authorization is None and challenge is not None and 16 <= len(challenge) <= 128:
            # discovery (server/discovery.py): prove the token without either side sending it
            return {"status": "ok", "name": host.name, "instance": host.instance,
                    "proof": proof(settings.token, challenge)}
        if authorization is None:
            return {"status": "ok"}
        await require_token(request)
        return {"status": "ok", "name": host.name, "instance": host.instance, "assigned": host.assignment is not None}

    @app.get("/info", dependencies=auth)
    async def info():
        return host.info() | {"links": relay.tally.snapshot()}

    @app.post("/assign", dependencies=auth)
    async def assign(body: AssignBody):
        return host.assign(body.model, body.first, body.last, body.dtype, body.kv_format, body.away, body.hosted,
                           relay.expert_links())

    @app.post("/profile", dependencies=auth)
    async def profile(body: ProfileBody):
        # blocks this worker while it runs: profiling happens before serving or while re-planning
        return host.profile(body.model, body.dtype, body.tokens, body.contexts, body.reps)

    @app.post("/probe/link", dependencies=auth)
    async def probe_link(body: LinkBody):
        try:
            return await measure_link(ws_url(body.target), settings.token, body.reps)
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            return _error(502, f"could not probe {body.target}: {type(exc).__name__}: {exc}")

    @app.websocket("/link")
    async def link(ws: WebSocket):
        # the handshake carries the token: a stranger's link is refused before it opens (HTTP 403)
        if not bearer_ok(ws.headers.get("authorization"), settings.token):
            await ws.close(code=1008)
            return
        await relay.serve(ws, "inbound")

    return app

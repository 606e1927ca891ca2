"""The worker's HTTP API. Every route needs the cluster token (/health without one answers only that the worker
is up). Errors are OpenAI-style error objects; an unexpected fault is a logged 500.

Tensor work runs inline on the event loop's thread: a worker serves one forward call at a time anyway,
a thread hand-off per call measured about 1 ms, and one thread doing all tensor work keeps a single
OpenMP team (see model/thread.py).

A forward call's output goes straight to the next stage named in its X-Route header; the last stage posts
it to the controller's callback (X-Callback). Each hop answers with a small JSON list of per-stage
figures, so every link carries one hidden state per step and the replies stay tiny.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Annotated

import httpx
import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from edgespec.model.kv_cache import KVCacheError
from edgespec.model.kv_pool import CapacityError
from edgespec.model.stage import SessionError, StepError
from edgespec.model.timing import CONTEXTS, TOKENS
from edgespec.workers.auth import bearer_ok
from edgespec.workers.client import NODELAY
from edgespec.workers.head_client import Reach
from edgespec.workers.head_routes import HeadHost, add_head_routes
from edgespec.workers.host import AssignmentError, NotAssignedError, StageHost
from edgespec.workers.probe import measure_link
from edgespec.workers.settings import WorkerSettings
from edgespec.workers.wire import WireError, decode_batch

log = logging.getLogger(__name__)
SMALL_BODY = 64 * 2**10  # outputs up to this size are written to the socket at once
MAX_SESSION_ID = 128  # characters of a session id (a path parameter, a fork's child, a batch entry's session)
# (exception, status, code): what a worker's refusal means; the codes are OpenAI-style strings
ERRORS = [(PermissionError, 401, "invalid_cluster_token"), (WireError, 400, "invalid_body"),
          (KVCacheError, 400, "invalid_value"), (SessionError, 404, "session_not_found"),
          (StepError, 409, "stale_step"), (NotAssignedError, 409, "not_assigned"),
          (AssignmentError, 409, "wrong_assignment"), (CapacityError, 507, "kv_cache_full"),
          (MemoryError, 507, "out_of_memory"), (FileNotFoundError, 400, "model_not_found"),
          (ValueError, 400, "invalid_value")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


SessionId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_SESSION_ID)]
Count = Annotated[int, Field(ge=0, lt=2**62)]  # steps, positions, capacities: far below int64's end


class AssignBody(Strict):
    model: str | None = None
    first: int = Field(ge=0, lt=2**31)
    last: int = Field(ge=1, lt=2**31)
    dtype: str = "float32"


class ProfileBody(Strict):
    model: str | None = None
    dtype: str = "float32"
    tokens: list[int] = Field(default_factory=lambda: list(TOKENS), min_length=1, max_length=32)
    contexts: list[int] = Field(default_factory=lambda: list(CONTEXTS), min_length=1, max_length=16)
    reps: int = Field(3, ge=1, le=50)


class LinkBody(Strict):
    target: str = Field(min_length=1, description="base URL of another worker")
    reps: int = Field(5, ge=1, le=50)


class OpenBody(Strict):
    step: Count
    capacity: int = Field(ge=1, lt=2**62)
    layers: list[int] | None = Field(None, min_length=2, max_length=2, description="[first, last) expected")


class CommitBody(Strict):
    step: Count
    kept: list[Count]
    dest: Count


class ForkBody(Strict):
    step: Count
    child: SessionId
    prefix_len: int = Field(ge=1, lt=2**62)
    capacity: int = Field(ge=1, lt=2**62)


class BodyError(ValueError):
    """A forward body without an acceptable Content-Length; `status` is 411 or 413."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error object, as the controller's own errors are."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def hop_url(url: str) -> str:
    """A next hop's base URL from X-Route or X-Callback, checked before any compute is spent on the call."""
    try:
        parsed = httpx.URL(url)
    except Exception as exc:  # httpx.InvalidURL, or a TypeError for what is not text
        raise ValueError(f"{url[:80]!r} is not a URL") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url[:80]!r} is not an http(s) URL")
    return url


def session_id(sid: str) -> str:
    if not 0 < len(sid) <= MAX_SESSION_ID:
        raise ValueError(f"a session id has 1 to {MAX_SESSION_ID} characters")
    return sid


async def _announce(client: httpx.AsyncClient, settings: WorkerSettings, name: str) -> None:
    """Tell the controller (--join) that this worker is here; retried until it answers."""
    url = settings.advertise_url or f"http://{settings.host}:{settings.port}"
    headers = {"authorization": f"Bearer {settings.token}"}
    for _ in range(60):
        await asyncio.sleep(1)  # uvicorn starts listening after the lifespan's start-up
        try:
            r = await client.post(settings.join.rstrip("/") + "/internal/cluster/join", headers=headers,
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
        received, exceeded = 0, False

        async def receive_counted():
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise BodyError(413, f"more than {limit} bytes")  # answered below, whatever the app made of it
            return message

        async def send_checked(message):
            if not exceeded:
                await send(message)
            elif message["type"] == "http.response.start":
                await too_large(scope, receive, send)

        await self.app(scope, receive_counted, send_checked)


class Turns:
    """Forward calls compute one at a time and, within a session, in step order (the segments of a pipelined
    prefill may arrive out of order). A call keeps the turn until its output is handed to the network: the
    next call's compute blocks the event loop, and must not hold back the transfer to the next stage."""

    def __init__(self, host: StageHost, timeout_s: float):
        self.host, self.timeout_s = host, timeout_s
        self.cond = asyncio.Condition()
        self.busy = False

    async def acquire(self, steps: list[tuple[str, int]]) -> None:
        """Wait for the turn of a call carrying these (session, step) pairs (a batch carries several)."""
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(
                    lambda: not self.busy and all(self.host.ready(s, step) for s, step in steps)), self.timeout_s)
            except TimeoutError:
                raise StepError(f"steps {steps} waited {self.timeout_s:.0f} s for the steps before them") from None
            self.busy = True

    async def release(self) -> None:
        async with self.cond:
            self.busy = False
            self.cond.notify_all()


def create_worker_app(settings: WorkerSettings) -> FastAPI:
    host = StageHost(settings)
    if settings.threads:
        torch.set_num_threads(settings.threads)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_keepalive_connections=8, keepalive_expiry=60)
        transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY)
        async with httpx.AsyncClient(timeout=settings.downstream_timeout_s, transport=transport) as client:
            app.state.client = client
            announce = asyncio.create_task(_announce(client, settings, host.name)) if settings.join else None
            yield
            if announce is not None:
                announce.cancel()

    app = FastAPI(title="edgespec worker", lifespan=lifespan)
    app.state.host = host
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
    add_head_routes(app, HeadHost(settings.model, lambda threads: Reach(settings.token, threads),
                                  int(settings.memory_budget_gib * 2**30)), auth)

    @app.get("/health")
    async def health(request: Request):
        # Liveness for anyone (a probe without the token); the details, which identify the process and what it
        # holds, only with the cluster's token. A wrong token is refused, so that a misconfigured controller
        # learns it at once.
        authorization = request.headers.get("authorization")
        if authorization is None:
            return {"status": "ok"}
        await require_token(request)
        return {"status": "ok", "name": host.name, "instance": host.instance, "assigned": host.assignment is not None}

    @app.get("/info", dependencies=auth)
    async def info():
        return host.info()

    @app.post("/assign", dependencies=auth)
    async def assign(body: AssignBody):
        return host.assign(body.model, body.first, body.last, body.dtype)

    @app.post("/profile", dependencies=auth)
    async def profile(body: ProfileBody):
        # blocks this worker while it runs: profiling happens before serving or while re-planning
        return host.profile(body.model, body.dtype, body.tokens, body.contexts, body.reps)

    @app.post("/probe/sink", dependencies=auth)
    async def sink(request: Request):
        return {"bytes": len(await request.body())}

    @app.post("/probe/link", dependencies=auth)
    async def probe_link(body: LinkBody):
        try:
            return await measure_link(app.state.client, hop_url(body.target), settings.token, body.reps)
        except httpx.HTTPError as exc:
            return _error(502, f"could not probe {body.target}: {type(exc).__name__}: {exc}")

    @app.post("/sessions/{sid}/open", dependencies=auth)
    async def open_session(sid: str, body: OpenBody):
        host.open(session_id(sid), body.step, body.capacity, body.layers)
        return {"ok": True}

    @app.post("/sessions/{sid}/commit", dependencies=auth)
    async def commit(sid: str, body: CommitBody):
        host.commit(session_id(sid), body.step, body.kept, body.dest)
        return {"ok": True}

    @app.post("/sessions/{sid}/fork", dependencies=auth)
    async def fork(sid: str, body: ForkBody):
        host.fork(session_id(sid), body.step, body.child, body.prefix_len, body.capacity)
        return {"ok": True}

    @app.delete("/sessions/{sid}", dependencies=auth)
    async def release(sid: str):
        host.release(sid)
        return {"ok": True}

    def int_param(request: Request, name: str) -> int:
        value = request.query_params.get(name, "")
        if not (value.isascii() and value.isdigit() and len(value) <= 18):  # below 2**62: no overflow downstream
            raise ValueError(f"query parameter {name!r} must be a non-negative integer, got {value[:40]!r}")
        return int(value)

    turns = Turns(host, settings.downstream_timeout_s)

    def next_hop(request: Request, path: str, params: dict, key: tuple[str, int]) -> tuple[str, dict, dict, bool]:
        """Where this stage's output goes: (url, headers, query, whether it is another stage). `path` and
        `params` address the next stage; the controller's callback takes the call's (session, step) key."""
        route = [hop_url(u) for u in request.headers.get("x-route", "").split(",") if u]
        callback = request.headers.get("x-callback")
        if callback is not None:
            hop_url(callback)
        headers = {"authorization": f"Bearer {settings.token}", "content-type": "application/octet-stream"}
        if route:
            headers["x-route"] = ",".join(route[1:])
            if callback:
                headers["x-callback"] = callback
            return route[0] + path, headers, params, True
        if callback:
            return callback, headers, {"session": key[0], "step": key[1]}, False
        raise ValueError("a forward call needs an X-Route or an X-Callback header")

    async def read_body(request: Request) -> bytes:
        await require_token(request)
        length = request.headers.get("content-length")
        if length is None or not length.isdigit() or int(length) > settings.max_body_bytes:
            raise BodyError(413 if length and length.isdigit() else 411,
                            f"forward bodies need a Content-Length of at most {settings.max_body_bytes} bytes")
        try:
            return await request.body()
        except ClientDisconnect:  # the sender died mid-body (a lost upstream worker): not this worker's fault
            raise BodyError(400, "the sender went away before its body arrived") from None

    async def relay(steps: list[tuple[str, int]], compute, target: str, headers: dict, params: dict):
        """Compute in turn (compute() -> (output body, seconds)) and send the output to the next hop."""
        await turns.acquire(steps)
        post = None
        try:
            out, seconds = compute()
            if len(out) > SMALL_BODY:  # a prefill segment: keep the turn until it is on its way
                sent = asyncio.Event()

                async def stream():
                    yield out
                    sent.set()  # the output is in the socket: the next call may compute

                headers["content-length"] = str(len(out))
                post = asyncio.create_task(app.state.client.post(target, content=stream(), headers=headers,
                                                                 params=params))
                handed = asyncio.create_task(sent.wait())
                await asyncio.wait([post, handed], return_when=asyncio.FIRST_COMPLETED)
                handed.cancel()
        finally:
            await turns.release()
        try:
            # a decoding step's output is small: it goes out at once, without a task and an event per hop
            reply = await (post or app.state.client.post(target, content=out, headers=headers, params=params))
        except httpx.HTTPError as exc:
            return _error(502, f"stage {host.name} could not reach {target}: {type(exc).__name__}: {exc}")
        if reply.status_code != 200:
            try:
                message = reply.json()["error"]["message"]
            except Exception:
                message = reply.text[:200]
            return _error(502, f"{target} answered {reply.status_code}: {message}")
        hop = {"stage": host.name, "bytes": len(out), "forward_ms": round(seconds * 1000, 3)}
        return JSONResponse({"hops": [hop, *reply.json().get("hops", [])]})

    async def forward(request: Request):
        # Plain Starlette routes: the hot path skips FastAPI's dependency and parameter machinery.
        body = await read_body(request)
        sid = session_id(request.path_params["sid"])
        start, step = int_param(request, "start"), int_param(request, "step")
        target, headers, params, onward = next_hop(request, f"/sessions/{sid}/forward", {"start": start, "step": step},
                                                   (sid, step))
        return await relay([(sid, step)], lambda: host.forward(sid, step, start, body, onward), target, headers,
                           params)

    async def forward_batch(request: Request):
        message = decode_batch(await read_body(request))
        target, headers, params, onward = next_hop(request, "/batch/forward", {}, message.key)
        return await relay([(s, step) for s, _, _, step in message.entries],
                           lambda: host.forward_batch(message, onward), target, headers, params)

    app.add_route("/sessions/{sid}/forward", forward, methods=["POST"])
    app.add_route("/batch/forward", forward_batch, methods=["POST"])
    return app

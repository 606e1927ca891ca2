"""The controller's and a worker's ASGI apps built in this process on the tiny model, and a synchronous client
that drives an app on one event loop of its own (for tests that need no real server process).

A plain module: test files import what they need from here (as from model_fixtures and processes).
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager

import httpx
from starlette.websockets import WebSocketDisconnect

from edgespec.workers.frames import pack, unpack

# a generation in a fuzz test costs about 10 ms per token on the tiny model: keep answers short
FUZZ_MAX_TOKENS = 4


def controller_app(model: str, **settings):
    """(app, service) of `edgespec serve` for `model` in-process (float32, naive by default, no drafters); the
    settings are ServeSettings fields."""
    from edgespec.decoding.policy import build_policies
    from edgespec.model.load import load_local
    from edgespec.model.source import resolve_model
    from edgespec.model.thread import ModelThread
    from edgespec.server.app import create_app
    from edgespec.server.boot import build_engine
    from edgespec.server.metrics import Metrics
    from edgespec.server.replanner import prefill_cuts
    from edgespec.server.service import CompletionService
    from edgespec.server.settings import ServeSettings

    values = {"model": model, "dtype": "float32", "policy": "naive", "headsplit": False, "eagle": "off",
              "medusa": "off", "kv_cache_gib": 0.25, **settings}
    config = ServeSettings(**values)
    loaded = load_local(resolve_model(model), config.dtype, config.kv_cache_gib, ModelThread(1),
                        prefill_cuts(config, None), kv=config.kv_format)
    policies = build_policies(default=config.policy, headsplit=config.headsplit,
                              headsplit_epsilon=config.headsplit_epsilon)
    service = CompletionService(loaded, build_engine(config, loaded, None), policies, config, Metrics())
    # no on_shutdown: several clients may enter the app's lifespan in turn; the caller closes service.engine
    return create_app(service), service


class LoopClient:
    """An httpx client for an ASGI app (its lifespan entered) on an event loop in a thread of its own, called
    synchronously: request(method, path, ...) -> httpx.Response, the whole body read (an SSE stream to its end)."""

    def __init__(self, app, base_url: str = "http://testserver", headers: dict | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.app, self.base_url, self.headers = app, base_url, headers or {}
        self._session_cm = self._run(self._open())

    @asynccontextmanager
    async def _session(self):
        async with self.app.router.lifespan_context(self.app):
            transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url=self.base_url, headers=self.headers,
                                         timeout=120) as client:
                yield client

    async def _open(self):
        session = self._session()
        self.client = await session.__aenter__()
        return session

    @staticmethod
    async def _cancel_rest() -> None:
        # what an app left running (sse-starlette's shutdown watchers) ends with the loop, not after it
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        async def call():
            response = await self.client.request(method, path, **kwargs)
            await response.aread()
            return response

        return self._run(call())

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def close(self) -> None:
        self._run(self._session_cm.__aexit__(None, None, None))
        self._run(self._cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def serves_a_chat_completion(model: str, name: str, tokens: int = 6, **settings) -> None:
    """`model` served in-process answers a greedy chat completion of `tokens` tokens (no request fails on it)."""
    app, service = controller_app(model, served_model_name=name, **settings)
    client = LoopClient(app)
    try:
        r = client.post("/v1/chat/completions", json={"model": name, "max_tokens": tokens, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "Hello"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == tokens
    finally:
        client.close()
        service.engine.close()


def assert_error_object(response, where: str = "") -> dict:
    """The response (httpx's or schemathesis') is a JSON OpenAI error object {"error": {"message", "type",
    "param", "code"}}; returns it."""
    content_type = response.headers.get("content-type") or ""
    if isinstance(content_type, list):  # schemathesis keeps every value of a header
        content_type = content_type[0]
    assert content_type.startswith("application/json"), (where, response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"error"}, (where, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, (where, err)
    assert isinstance(err["message"], str) and err["message"], (where, err)
    assert err["type"] == ("server_error" if response.status_code >= 500 else "invalid_request_error"), (where, err)
    assert err["param"] is None or isinstance(err["param"], str), (where, err)
    assert err["code"] is None or isinstance(err["code"], str), (where, err)
    return err


BUDGETS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"), "/v1/completions": ("max_tokens",),
           "/v1/responses": ("max_output_tokens",)}


def short_answers(path: str, body):
    """A request body for `path` with its token budget bounded by FUZZ_MAX_TOKENS (set where absent), so that
    every valid generation a fuzz test sends is cheap; anything else is returned as it is."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key in BUDGETS.get(path, ()):
        value = out.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > FUZZ_MAX_TOKENS):
            out[key] = FUZZ_MAX_TOKENS
    return out


class FakeLink:
    """What Relay.serve needs of a WebSocket: the frames to receive, in order, and the frames it sent back."""

    def __init__(self, frames: list[bytes]):
        self.frames, self.sent = list(frames), []

    async def accept(self) -> None:
        pass

    async def receive_bytes(self) -> bytes:
        if not self.frames:
            raise WebSocketDisconnect(1000)
        return self.frames.pop(0)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(unpack(data))


def on_link(client: LoopClient, *frames: bytes) -> list[tuple[dict, bytes]]:
    """Serve these frames on one link that said hello first; the frames the worker sent back."""
    link = FakeLink([pack({"op": "hello", "controller": "fuzz"}), *frames])
    client._run(client.app.state.relay.serve(link, "fuzz"))
    return link.sent

"""A worker's links: the persistent WebSocket connections its forward calls and session operations travel on.

Every link is one long-lived connection carrying frames (workers/frames.py). A controller dials each worker
once and says hello with its id: on that link it sends session operations (answered with an ack) and a step's
first forward; the worker sends back on it the last stage's result and any stage's error. A worker dials the
next stage named in a forward's route, once, and relays its output there; the next stage answers nothing on a
peer link (its result or error goes to the controller named in the header), so a step costs one message per
hop and no reply travels back along the chain.

Exactly-once is the step numbers' (workers/host.py): a message sent again after a reconnection is a retry,
answered from the kept output without being applied twice, so both ends may resend whatever they are unsure
arrived. A worker applies a session's steps in order: a forward that arrives before the operation it follows
(they may come on different links) waits for it, up to the downstream timeout.

Tensor work runs inline on the event loop's thread, as the HTTP routes' did: a worker computes one message at
a time anyway, and one thread doing all tensor work keeps a single OpenMP team (model/thread.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import websockets
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect

from edgespec.model.stage import StepError
from edgespec.workers.errors import classify
from edgespec.workers.frames import MAX_HEADER, FrameError, pack, unpack
from edgespec.workers.host import StageHost
from edgespec.workers.settings import WorkerSettings
from edgespec.workers.wire import decode_batch

log = logging.getLogger(__name__)
MAX_SESSION_ID = 128  # characters of a session id (a fork's child, a batch entry's session)


def ws_url(url: str) -> str:
    """A worker's link address from its base URL: http(s)://host:port -> ws(s)://host:port/link; ValueError for
    what is not an http(s) URL (a route is checked before any compute is spent on the call)."""
    try:
        parsed = httpx.URL(url)
    except Exception as exc:  # httpx.InvalidURL, or a TypeError for what is not text
        raise ValueError(f"{str(url)[:80]!r} is not a URL") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url[:80]!r} is not an http(s) URL")
    return {"http": "ws", "https": "wss"}[parsed.scheme] + url[len(parsed.scheme):].rstrip("/") + "/link"


def session_id(value) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_ID:
        raise ValueError(f"a session id is a string of 1 to {MAX_SESSION_ID} characters")
    return value


def count(header: dict, name: str) -> int:
    """A non-negative integer field (step, start, capacity...) below 2**62: no overflow downstream."""
    return nonneg(header.get(name), name)


def nonneg(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
        raise ValueError(f"{name} must be a non-negative integer, got {str(value)[:40]!r}")
    return value


def route_of(header: dict) -> list[str]:
    route = header.get("route", [])
    if not isinstance(route, list) or len(route) > 64 or not all(isinstance(u, str) for u in route):
        raise ValueError("route must be a list of worker URLs")
    for url in route:
        ws_url(url)
    return route


class LinkTally:
    """Frames and bytes per link, both ways, for /info and the controller's dashboard."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # sent, sent bytes, got, got bytes

    def sent(self, link: str, nbytes: int) -> None:
        c = self.counts[link]
        c[0] += 1
        c[1] += nbytes

    def got(self, link: str, nbytes: int) -> None:
        c = self.counts[link]
        c[2] += 1
        c[3] += nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {link: dict(zip(("sent", "sent_bytes", "received", "received_bytes"), c, strict=True))
                for link, c in self.counts.items()}


class Relay:
    """The worker's side of every link: serves inbound links (`serve`), dials the next stages, and answers the
    controllers that said hello."""

    def __init__(self, host: StageHost, settings: WorkerSettings):
        self.host, self.settings = host, settings
        self.controllers: dict[str, WebSocket] = {}  # hello id -> its link
        self.peers: dict[str, ClientConnection] = {}  # next stage's link URL -> the link this worker dialed
        self.dialing: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.turn = asyncio.Condition()  # notified whenever a step was applied, when a call waits for one
        self.waiting = 0
        self.compute = ThreadPoolExecutor(1, "stage")  # the passes that call for experts (StageHost.splits)
        self.tally = LinkTally()
        self.max_size = settings.max_body_bytes + MAX_HEADER + 4

    # inbound

    async def serve(self, ws: WebSocket, peer: str) -> None:
        """Read one inbound link until it closes; `peer` names it in the tally."""
        await ws.accept()
        mine: list[str] = []
        try:
            while True:
                data = await ws.receive_bytes()
                self.tally.got(peer, len(data))
                try:
                    header, body = unpack(data)
                except FrameError as exc:
                    await self._send(ws, peer, pack({"op": "error", "status": 400, "code": "invalid_frame",
                                                     "message": str(exc)}))
                    continue
                if header["op"] == "hello":
                    cid = header.get("controller")
                    if isinstance(cid, str) and 0 < len(cid) <= 64:
                        self.controllers[cid] = ws
                        mine.append(cid)
                    continue
                await self.handle(ws, peer, header, body)
        except (WebSocketDisconnect, RuntimeError):  # RuntimeError: a receive after the peer's close
            pass
        finally:
            for cid in mine:
                if self.controllers.get(cid) is ws:
                    del self.controllers[cid]

    async def handle(self, ws: WebSocket, peer: str, header: dict, body: bytes) -> None:
        op = header["op"]
        if op in ("forward", "batch"):
            await self.forward(header, body)
        elif op in ("open", "commit", "fork"):
            await self._send(ws, peer, pack(self.operate(op, header)))
        elif op == "release":  # no ack: the pool's figures after it, for the controller's /metrics
            with contextlib.suppress(ValueError):
                self.host.release(session_id(header.get("session")))
            await self._send(ws, peer, pack({"op": "kv", **self.host.kv_report().fields()}))
        elif op == "ping":
            await self._send(ws, peer, pack({"op": "pong", "id": header.get("id"), "bytes": len(body)}))
        else:
            await self._send(ws, peer, pack({"op": "error", "status": 400, "code": "invalid_frame",
                                             "message": f"a worker does not take {op!r} frames"}))

    def operate(self, op: str, h: dict) -> dict:
        """Apply a session operation; its ack (ok, or the error's status, code and message)."""
        ack = {"op": "ack", "id": h.get("id")}
        try:
            sid, step = session_id(h.get("session")), count(h, "step")
            if op == "open":
                layers = h.get("layers")
                if layers is not None and (not isinstance(layers, list) or len(layers) != 2):
                    raise ValueError("layers must be [first, last)")
                self.host.open(sid, step, count(h, "capacity") or 1, layers)
            elif op == "commit":
                kept = h.get("kept")
                if not isinstance(kept, list) or len(kept) > 2**16:
                    raise ValueError("kept must be a list of slots")
                self.host.commit(sid, step, [nonneg(k, "a kept slot") for k in kept], count(h, "dest"))
            else:
                self.host.fork(sid, step, session_id(h.get("child")), count(h, "prefix_len") or 1,
                               count(h, "capacity") or 1)
        except Exception as exc:
            return ack | self._error(exc)
        self._notify()
        return ack | {"ok": True} | self.host.kv_report().fields()

    async def forward(self, header: dict, body: bytes) -> None:
        """Compute a forward or batch message in its turn, then relay the output along its route, or send it to
        the controller as the result; any failure goes to the controller as an error frame under the call's key."""
        key = (header.get("session"), header.get("step"))
        try:
            route = route_of(header)
            if header["op"] == "forward":
                sid, step, start = session_id(header.get("session")), count(header, "step"), count(header, "start")
                steps = [(sid, step)]
            else:
                message = decode_batch(body)
                steps = [(s, step) for s, _, _, step in message.entries]
                key = message.key
            await self._wait_turn(steps)
            if header["op"] == "forward":
                run = partial(self.host.forward, sid, step, start, body, bool(route))
            else:
                run = partial(self.host.forward_batch, message, bool(route))
            if self.host.splits:
                # a pass that calls other workers for experts waits on this loop for their answers: on a thread
                # of its own, always the same one (the loop stays free to carry the calls and answer theirs; one
                # thread keeps torch's OpenMP to one team of threads)
                out, seconds = await asyncio.get_running_loop().run_in_executor(self.compute, run)
            else:
                out, seconds = run()
            self._notify()
            hops = [*header.get("hops", []), {"stage": self.host.name, "bytes": len(out),
                                               "forward_ms": round(seconds * 1000, 3),
                                               **self.host.kv_report().fields()}]
            if route:
                await self.send_peer(route[0], pack({**header, "route": route[1:], "hops": hops}, out))
            else:
                await self.to_controller(header.get("reply"), pack(
                    {"op": "result", "session": key[0], "step": key[1], "hops": hops}, out))
        except Exception as exc:
            await self.to_controller(header.get("reply"), pack(
                {"op": "error", "session": key[0], "step": key[1], **self._error(exc)}))

    def _error(self, exc: Exception) -> dict:
        status, code = classify(exc)
        if status >= 500 and code == "internal_error":
            log.error("unexpected error on a link", exc_info=exc)
        return {"status": status, "code": code, "message": f"stage {self.host.name}: {exc}"}

    async def _wait_turn(self, steps: list[tuple[str, int]]) -> None:
        ready = lambda: all(self.host.ready(s, n) for s, n in steps)  # noqa: E731
        if ready():  # the usual case: a link delivers a session's steps in order
            return
        self.waiting += 1
        try:
            async with self.turn:
                await asyncio.wait_for(self.turn.wait_for(ready), self.settings.downstream_timeout_s)
        except TimeoutError:
            raise StepError(f"steps {steps} waited {self.settings.downstream_timeout_s:.0f} s for the steps "
                            "before them") from None
        finally:
            self.waiting -= 1

    def _notify(self) -> None:
        if not self.waiting:
            return

        async def wake():
            async with self.turn:
                self.turn.notify_all()

        asyncio.get_running_loop().create_task(wake())

    # outbound

    async def _send(self, ws: WebSocket, peer: str, data: bytes) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the controller went away: it resends
            await ws.send_bytes(data)
            self.tally.sent(peer, len(data))

    async def to_controller(self, cid, data: bytes) -> None:
        """To the controller that said hello as `cid`; dropped when it is not linked (it times out and resends)."""
        ws = self.controllers.get(cid) if isinstance(cid, str) else None
        if ws is not None:
            await self._send(ws, "controller", data)

    async def send_peer(self, base_url: str, data: bytes) -> ClientConnection:
        """To the next stage, over the link this worker keeps to it, dialed (again) when there is none; a send
        that fails on a link that was up is tried once more on a new one (a retry, for the step numbers).
        Returns the link it went on."""
        url = ws_url(base_url)
        for _ in range(2):
            link = await self._peer(url)
            try:
                await link.send(data)
                self.tally.sent(base_url, len(data))
                return link
            except websockets.ConnectionClosed:
                if self.peers.get(url) is link:
                    del self.peers[url]
        raise ConnectionError(f"the link to {base_url} closed")

    async def _peer(self, url: str) -> ClientConnection:
        async with self.dialing[url]:
            link = self.peers.get(url)
            if link is None:
                try:
                    link = await connect(url, additional_headers={"authorization": f"Bearer {self.settings.token}"},
                                         max_size=self.max_size, compression=None, ping_interval=None,
                                         open_timeout=self.settings.downstream_timeout_s)
                except (OSError, websockets.InvalidHandshake, TimeoutError) as exc:
                    raise ConnectionError(f"could not link to {url}: {type(exc).__name__}: {exc}") from None
                self.peers[url] = link
                asyncio.get_running_loop().create_task(self._drain(url, link))
            return link

    async def _drain(self, url: str, link: ClientConnection) -> None:
        """Read what comes back on a peer link (a layer stage sends back only pongs and errors about malformed
        frames; a subclass's calls get their answers here) so that the connection's buffers never fill, and
        forget the link when it closes."""
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in link:
                with contextlib.suppress(FrameError):
                    self.on_peer_frame(url, *unpack(data))
        if self.peers.get(url) is link:
            del self.peers[url]
        self.on_peer_closed(url, link)

    def on_peer_frame(self, url: str, header: dict, body: bytes) -> None:
        """A frame that came back on the link to `url`."""
        if header["op"] == "error":
            log.warning("the next stage at %s refused a frame: %s", url, header.get("message"))

    def on_peer_closed(self, url: str, link: ClientConnection) -> None:
        """A peer link closed (it is forgotten already: the next send dials a new one)."""

    async def close(self) -> None:
        self.compute.shutdown(wait=False)
        for link in list(self.peers.values()):
            with contextlib.suppress(Exception):
                await link.close()
        self.peers.clear()

"""A test's link to a worker: what the controller's Uplink does, one call at a time and in plain view."""

from __future__ import annotations

import itertools
import uuid

from websockets.sync.client import connect

from edgespec.workers.frames import pack, unpack
from edgespec.workers.relay import ws_url


class TestLink:
    """A link that said hello as a controller: session operations and HeadSplit calls answered by acks, forward
    calls answered by a result or an error frame (the worker sends both back here when the route ends)."""

    __test__ = False  # not a test class, for pytest

    def __init__(self, url: str, token: str, max_size: int = 2**27):
        self.id = uuid.uuid4().hex
        self.conn = connect(ws_url(url), additional_headers={"authorization": f"Bearer {token}"},
                            compression=None, max_size=max_size, ping_interval=None, legacy=True)
        self.conn.send(pack({"op": "hello", "controller": self.id}))
        self.ids = itertools.count(1)

    def op(self, op: str, **fields) -> dict:
        """A session operation (open, commit, fork) -> its ack."""
        mid = next(self.ids)
        self.conn.send(pack({"op": op, "id": mid, **fields}))
        return self.wait(lambda h: h["op"] == "ack" and h.get("id") == mid)[0]

    def call(self, op: str, body: bytes = b"", **fields) -> tuple[dict, bytes]:
        """A call answered by an ack with a body (HeadSplit's head_open, attend, ffn, run) -> (ack, body)."""
        mid = next(self.ids)
        self.conn.send(pack({"op": op, "id": mid, **fields}, body))
        return self.wait(lambda h: h["op"] == "ack" and h.get("id") == mid)

    def send(self, header: dict, body: bytes = b"") -> None:
        self.conn.send(pack({"reply": self.id, **header}, body))

    def forward(self, session: str, step: int, start: int, body: bytes, **fields) -> tuple[dict, bytes]:
        """One forward call through this worker alone (no route) -> (result or error header, body)."""
        self.send({"op": "forward", "session": session, "step": step, "start": start, **fields}, body)
        return self.answer(session, step)

    def answer(self, session: str, step: int, timeout: float = 60) -> tuple[dict, bytes]:
        return self.wait(lambda h: h["op"] in ("result", "error") and (h.get("session"), h.get("step")) ==
                         (session, step), timeout)

    def wait(self, match, timeout: float = 60) -> tuple[dict, bytes]:
        while True:
            header, body = unpack(self.conn.recv(timeout))
            if match(header):
                return header, body

    def close(self) -> None:
        self.conn.close()

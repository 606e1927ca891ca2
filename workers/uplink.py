"""The controller's links to its workers: one WebSocket per worker (workers/relay.py has the other side), each
read by a thread of its own that files what arrives, for the model thread to take.

A link is dialed when first used and again after it closed; on a new link the controller says hello with its
id, so that results and errors of the steps it starts find their way back to it. A link that closes fails
every wait on its worker's answers at once (a lost worker is known in milliseconds, not after the timeout),
and every wait for a result, since the closed link may have been on the step's route.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import uuid

import websockets
from websockets.sync.client import ClientConnection, connect

from edgespec.model.kv_pool import CapacityError
from edgespec.model.stage import StageFailure
from edgespec.workers.frames import MAX_HEADER, FrameError, pack, unpack
from edgespec.workers.kv_report import KVReports
from edgespec.workers.relay import ws_url

MAX_MESSAGE = 64 * 2**20 + MAX_HEADER + 4  # a worker's default max_body_bytes, framed


def refusal(worker: str, header: dict) -> Exception:
    """The exception for a worker's error frame or failed ack: CapacityError for a full KV pool (507), as
    in-process, else StageFailure (503 for the worker's own faults and lost next stages, 502 for refusals)."""
    status = header.get("status", 500)
    message = f"worker {worker}: {header.get('message', 'failed')}"
    if status == 507:
        return CapacityError(message)
    return StageFailure(message, 503 if status >= 500 else 502, header.get("code"))


class Mailbox:
    """Answers filed by the links' readers, taken by the model thread: results and errors by (session, step),
    acks and pongs by message id."""

    def __init__(self) -> None:
        self._items: dict[object, tuple[dict, bytes] | Exception] = {}
        self._waiting: dict[object, str | None] = {}  # key -> the worker whose link it waits on (None: any)
        self._cond = threading.Condition()

    def put(self, key, item: tuple[dict, bytes] | Exception) -> None:
        with self._cond:
            self._items[key] = item
            self._cond.notify_all()

    def expect(self, key, worker: str | None) -> None:
        """Register a wait before sending what it answers, so that a link closing in between fails it."""
        with self._cond:
            self._waiting[key] = worker
            self._items.pop(key, None)  # a stale answer to an earlier attempt of the same step

    def take(self, key, timeout: float, what: str) -> tuple[dict, bytes]:
        with self._cond:
            try:
                if not self._cond.wait_for(lambda: key in self._items, timeout):
                    raise StageFailure(f"{what} never arrived", 504)
                item = self._items.pop(key)
            finally:
                self._waiting.pop(key, None)
        if isinstance(item, Exception):
            raise item
        return item

    def fail(self, worker: str, why: str) -> None:
        """A link closed: every wait on that worker's answers, and every wait for a result, fails now."""
        with self._cond:
            for key, on in self._waiting.items():
                if key not in self._items and on in (worker, None):
                    self._items[key] = StageFailure(f"the link to worker {worker} closed: {why}", 503)
            self._cond.notify_all()

    def forget(self, keys) -> None:
        """Stop waiting for these keys (their request failed on another key)."""
        with self._cond:
            for key in keys:
                self._waiting.pop(key, None)
                self._items.pop(key, None)

    def drop(self, session: str) -> None:
        with self._cond:
            for key in [k for k in self._items if isinstance(k, tuple) and k[0] == session]:
                del self._items[key]


class Uplink:
    """The controller's link to one worker; the KV reports the worker sends on it are filed in `reports`."""

    def __init__(self, name: str, url: str, token: str, controller: str, mailbox: Mailbox, timeout_s: float,
                 reports: KVReports):
        self.name, self.url, self.token, self.controller = name, url, token, controller
        self.mailbox, self.timeout_s, self.reports = mailbox, timeout_s, reports
        self.conn: ClientConnection | None = None
        self.lock = threading.Lock()

    def _dial(self) -> ClientConnection:
        with self.lock:
            if self.conn is None:
                try:
                    conn = connect(ws_url(self.url), additional_headers={"authorization": f"Bearer {self.token}"},
                                   max_size=MAX_MESSAGE, compression=None, open_timeout=self.timeout_s,
                                   ping_interval=None, close_timeout=1, legacy=True)
                except (OSError, websockets.InvalidHandshake, TimeoutError) as exc:
                    raise StageFailure(f"worker {self.name} is unreachable: {type(exc).__name__}: {exc}",
                                       503) from None
                conn.send(pack({"op": "hello", "controller": self.controller}))
                self.conn = conn
                threading.Thread(target=self._read, args=(conn,), name=f"link-{self.name}", daemon=True).start()
            return self.conn

    def send(self, data: bytes) -> None:
        """Send a frame, on a new link when the last one closed; a failed send is tried once on a new link (a
        retry, for the step numbers)."""
        for attempt in range(2):
            conn = self._dial()
            try:
                conn.send(data)
                return
            except websockets.ConnectionClosed as exc:
                self._closed(conn, str(exc))
                if attempt:
                    raise StageFailure(f"the link to worker {self.name} closed: {exc}", 503) from None

    def send_if_linked(self, data: bytes) -> None:
        """Send on the link if it is up, else not at all (a release: a worker without a link to this controller
        may be down, and one that restarted has lost the session anyway)."""
        conn = self.conn
        if conn is not None:
            with contextlib.suppress(websockets.ConnectionClosed):
                conn.send(data)

    def _closed(self, conn: ClientConnection, why: str) -> None:
        with self.lock:
            if self.conn is conn:
                self.conn = None
        self.mailbox.fail(self.name, why)

    def _read(self, conn: ClientConnection) -> None:
        try:
            for data in conn:
                try:
                    header, body = unpack(data)
                except FrameError:
                    continue
                op = header["op"]
                self.reports.file(self.name, header)  # an ack's, or a frame of its own after a release
                if op == "result":
                    self.mailbox.put((header.get("session"), header.get("step")), (header, body))
                elif op == "error" and "session" in header:
                    self.mailbox.put((header.get("session"), header.get("step")), refusal(self.name, header))
                elif op in ("ack", "pong"):
                    self.mailbox.put(header.get("id"), (header, body))
            self._closed(conn, "closed by the worker")
        except websockets.ConnectionClosed as exc:
            self._closed(conn, str(exc))
        except Exception as exc:  # a reader that dies must still fail the waits on it
            self._closed(conn, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class Answer:
    """A call on a link whose ack is on its way (a HeadSplit device call): `result()` waits for it."""

    def __init__(self, mailbox: Mailbox, worker: str, mid: int, timeout_s: float, what: str):
        self.mailbox, self.worker, self.mid, self.timeout_s, self.what = mailbox, worker, mid, timeout_s, what

    def ack(self) -> tuple[dict, bytes]:
        """(the ack's header, its body), refused or not; a StageFailure at once when the link closes first, 504
        past the timeout."""
        return self.mailbox.take(self.mid, self.timeout_s, self.what)

    def result(self) -> tuple[dict, bytes]:
        """The ack, or the worker's refusal raised (CapacityError, StageFailure)."""
        header, body = self.ack()
        if not header.get("ok"):
            raise refusal(self.worker, header)
        return header, body


class Uplinks:
    """Links to every worker by URL, one mailbox for their answers, request/ack over them, and the workers' latest
    KV reports (workers/kv_report.py) by name."""

    def __init__(self, token: str, timeout_s: float):
        self.token, self.timeout_s = token, timeout_s
        self.controller = uuid.uuid4().hex
        self.mailbox = Mailbox()
        self.reports = KVReports()
        self.links: dict[str, Uplink] = {}
        self.ids = itertools.count(1)

    def link(self, name: str, url: str) -> Uplink:
        link = self.links.get(url)
        if link is None or link.name != name:
            link = self.links[url] = Uplink(name, url, self.token, self.controller, self.mailbox, self.timeout_s,
                                            self.reports)
        return link

    def request(self, targets: list[tuple[str, str]], header: dict) -> list[dict]:
        """Send `header` (an op answered by an ack) to every (name, url) at once; their acks in order, or the
        first refusal raised (CapacityError, StageFailure with the worker's code)."""
        answers: list[Answer] = []
        try:
            for name, url in targets:
                answers.append(self.start(name, url, header))
            acks = [answer.ack()[0] for answer in answers]  # every one, so that no late ack is left filed
        finally:
            self.mailbox.forget([answer.mid for answer in answers])
        for answer, ack in zip(answers, acks, strict=True):
            if not ack.get("ok"):
                raise refusal(answer.worker, ack)
        return acks

    def start(self, name: str, url: str, header: dict, body: bytes = b"") -> Answer:
        """Send one call (an op answered by an ack, with a body) to a worker without waiting for it; what waits."""
        mid = next(self.ids)
        self.mailbox.expect(mid, name)
        try:
            self.link(name, url).send(pack({**header, "id": mid}, body))
        except Exception:
            self.mailbox.forget([mid])
            raise
        return Answer(self.mailbox, name, mid, self.timeout_s, f"worker {name}'s answer to {header['op']}")

    def close(self) -> None:
        for link in self.links.values():
            link.close()

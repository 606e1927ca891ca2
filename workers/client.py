"""The controller's side of remote stages: a pipeline of workers used as one Stage.

A forward call (one session's, or a BatchMessage of a step shared by several) goes to the first worker with
the rest of the route; each worker forwards its output to the next, and the last one posts the final hidden
state to the controller's callback, where a ResultMailbox holds it for the waiting model thread. Calls carry
per-session step numbers, so a retried call is applied once. Runs on the controller's model thread
(synchronous httpx with pooled keep-alive connections).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import torch

from edgespec.model.kv_pool import CapacityError
from edgespec.model.stage import StageFailure
from edgespec.workers.wire import BatchMessage, decode, encode, encode_batch

# A forward call may be written as headers, then body; with Nagle's algorithm on, a small second write can
# wait for the peer's delayed ACK. On loopback here it made no measurable difference, but on a real link
# it can add a round trip per hop, so every stage-to-stage connection turns it off.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
MAX_SEGMENTS = 16  # pipelined prefill segments in flight at once


class ResultMailbox:
    """Final hidden states posted by the last stage, keyed by (session, step), taken by the model thread."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, int], bytes] = {}
        self._cond = threading.Condition()

    def put(self, session: str, step: int, body: bytes) -> None:
        with self._cond:
            self._items[(session, step)] = body
            self._cond.notify_all()

    def take(self, session: str, step: int, timeout: float) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: (session, step) in self._items, timeout):
                raise StageFailure(f"the last stage's result for step {step} never arrived", 504)
            return self._items.pop((session, step))

    def drop(self, session: str) -> None:
        with self._cond:
            for key in [k for k in self._items if k[0] == session]:
                del self._items[key]


@dataclass
class WorkerRef:
    """A worker and the layers it is assigned."""

    url: str
    name: str
    first: int
    last: int


class RemotePipeline:
    """Workers in layer order, used as one Stage by the ModelRunner."""

    def __init__(self, workers: list[WorkerRef], token: str, callback_url: str, mailbox: ResultMailbox,
                 model: str | None, dtype: str, timeout_s: float = 60.0, on_hop=None):
        self.callback_url = callback_url
        self.mailbox = mailbox
        self.model, self.dtype = model, dtype
        self.timeout_s = timeout_s
        self.on_hop = on_hop  # on_hop(link, bytes, stage, forward_ms): metrics
        self.http = httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=timeout_s,
                                 transport=httpx.HTTPTransport(retries=1, socket_options=NODELAY),
                                 limits=httpx.Limits(max_keepalive_connections=16, keepalive_expiry=60))
        self.steps: dict[str, int] = defaultdict(int)
        self.wire_stats: dict[str, dict[str, list[int]]] = {}
        self.pool: ThreadPoolExecutor | None = None  # senders of pipelined prefill segments
        self.replace(workers)

    def replace(self, workers: list[WorkerRef]) -> None:
        """Route through these workers from now on (after a re-plan has assigned them)."""
        self.workers = list(workers)
        names = ["controller", *(w.name for w in workers), "controller"]
        self.links = [f"{a}->{b}" for a, b in itertools.pairwise(names)]

    # plumbing

    def _call(self, worker: WorkerRef, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            r = self.http.request(method, worker.url + path, **kwargs)
        except httpx.TimeoutException as exc:
            raise StageFailure(f"worker {worker.name} timed out ({type(exc).__name__})", 504) from exc
        except httpx.HTTPError as exc:
            raise StageFailure(f"worker {worker.name} is unreachable: {type(exc).__name__}: {exc}", 503) from exc
        if r.status_code == 507:  # the worker's memory budget is full: the same error as in-process
            raise CapacityError(f"worker {worker.name}: {_message(r)}")
        if r.status_code != 200:
            raise StageFailure(f"worker {worker.name} answered {r.status_code}: {_message(r)}",
                               503 if r.status_code >= 500 else 502)
        return r

    def _step(self, session: str) -> int:
        self.steps[session] += 1
        return self.steps[session]

    def assign(self, worker: WorkerRef) -> dict:
        body = {"model": self.model, "first": worker.first, "last": worker.last, "dtype": self.dtype}
        return self._call(worker, "POST", "/assign", json=body, timeout=max(self.timeout_s, 300)).json()

    def _each(self, session: str, op: str, body: dict) -> None:
        step = self._step(session)
        for w in self.workers:
            self._call(w, "POST", f"/sessions/{session}/{op}", json={"step": step, **body})

    # the Stage interface

    def open(self, session: str, capacity: int) -> None:
        step = self._step(session)
        self.wire_stats[session] = {link: [0, 0] for link in self.links}
        for w in self.workers:
            path = f"/sessions/{session}/open"
            body = {"step": step, "capacity": capacity, "layers": [w.first, w.last]}
            try:
                self._call(w, "POST", path, json=body)
            except StageFailure as exc:
                if "holds no layers" not in str(exc):
                    raise
                self.assign(w)  # the worker restarted: give it its layers back, then open again
                self._call(w, "POST", path, json=body)

    def _post(self, path: str, params: dict, body: bytes) -> httpx.Response:
        """POST a forward call to the first worker; the reply comes once the last stage has posted."""
        headers = {"x-route": ",".join(w.url for w in self.workers[1:]), "x-callback": self.callback_url,
                   "content-type": "application/octet-stream"}
        return self._call(self.workers[0], "POST", path, content=body, headers=headers, params=params)

    def _send(self, session: str, step: int, start: int, body: bytes) -> httpx.Response:
        return self._post(f"/sessions/{session}/forward", {"start": start, "step": step}, body)

    def _result(self, session: str, step: int, sent: int, reply: httpx.Response) -> torch.Tensor:
        hops = reply.json()["hops"]
        self._record({session: 1.0}, [sent] + [h["bytes"] for h in hops], hops)
        return decode(self.mailbox.take(session, step, self.timeout_s), ("hidden",))["hidden"]

    def forward(self, session, hidden, positions, start, mask=None):
        # hidden [B, T, H] -> hidden [B, T, H] after every worker's layers
        b, t = hidden.shape[:2]
        default = torch.arange(start, start + t).expand(b, -1)
        body = encode({"hidden": hidden, "positions": None if torch.equal(positions, default) else positions,
                       "mask": mask})
        step = self._step(session)
        return self._result(session, step, len(body), self._send(session, step, start, body))

    def forward_batch(self, entries, hidden, positions):
        # hidden [M, H] at positions [M] -> [M, H]: every session's rows in one message per link; each session's
        # wire figures count the message once, with its share of the bytes by rows
        message = BatchMessage([(e.session, e.start, e.length, self._step(e.session)) for e in entries], hidden,
                               positions, [e.mask for e in entries])
        body = encode_batch(message)
        hops = self._post("/batch/forward", {}, body).json()["hops"]
        self._record({e.session: e.length / hidden.shape[0] for e in entries}, [len(body)] + [h["bytes"] for h in hops],
                     hops)
        return decode(self.mailbox.take(*message.key, self.timeout_s), ("hidden",))["hidden"]

    def forward_segments(self, session: str, hidden: torch.Tensor, start: int, cuts: list[int]) -> torch.Tensor:
        """A pipelined prefill: hidden [1, T, H] at slots start.. cut into segments ending at `cuts` (relative,
        the last == T), all sent at once so that worker k runs segment i while worker k-1 runs i+1 (workers
        apply a session's steps in order). Returns hidden [1, T, H]."""
        bounds = list(itertools.pairwise([0, *cuts]))
        steps = [self._step(session) for _ in bounds]
        bodies = [encode({"hidden": hidden[:, a:b]}) for a, b in bounds]
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=MAX_SEGMENTS, thread_name_prefix="segments")
        sends = [self.pool.submit(self._send, session, step, start + a, body)
                 for step, (a, _), body in zip(steps, bounds, bodies, strict=True)]
        # In order: a failed segment raises here, before waiting for results that will not come.
        outs = [self._result(session, step, len(body), sent.result())
                for step, body, sent in zip(steps, bodies, sends, strict=True)]
        return torch.cat(outs, dim=1)

    def _record(self, shares: dict[str, float], sizes: list[int], hops: list[dict]) -> None:
        # one message per link, of these sizes; shares: each session's part of it
        for i, (link, size) in enumerate(zip(self.links, sizes, strict=False)):
            for session, share in shares.items():
                stats = self.wire_stats.get(session)
                if stats is not None:
                    counts = stats.setdefault(link, [0, 0])
                    counts[0] += round(size * share)
                    counts[1] += 1
            if self.on_hop:
                hop = hops[i - 1] if i > 0 else None
                self.on_hop(link, size, hop["stage"] if hop else None, hop["forward_ms"] if hop else None)

    def commit(self, session: str, kept: list[int], dest: int) -> None:
        self._each(session, "commit", {"kept": kept, "dest": dest})

    def fork(self, session: str, child: str, prefix_len: int, capacity: int) -> None:
        self._each(session, "fork", {"child": child, "prefix_len": prefix_len, "capacity": capacity})
        self.wire_stats[child] = {link: [0, 0] for link in self.links}

    def release(self, session: str) -> None:
        """Free the session everywhere; a worker that is down has lost it already."""
        self.steps.pop(session, None)
        self.wire_stats.pop(session, None)
        self.mailbox.drop(session)
        for w in self.workers:
            with contextlib.suppress(httpx.HTTPError):
                self.http.delete(f"{w.url}/sessions/{session}", timeout=5)

    def wire(self, session: str) -> dict[str, tuple[int, int]]:
        return {link: (b, n) for link, (b, n) in self.wire_stats.get(session, {}).items()}

    def session_bytes(self, session: str) -> None:
        """Unknown here (the workers hold the caches): the runner estimates."""
        return None

    def kv_bytes(self) -> int:
        return 0  # held on the workers: see their /info

    def pool_blocks(self) -> tuple[int, int]:
        return 0, 0  # the pools are the workers': see their /info

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except Exception:
        return r.text[:200]

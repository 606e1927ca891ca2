"""The controller's side of remote stages: a pipeline of workers used as one Stage.

A forward call (one session's, or a BatchMessage of a step shared by several) goes over the link to the first
worker with the rest of the route in its header; each worker relays its output to the next over the link it
keeps to it, and the last one sends the final hidden state back over its link to the controller, where the
model thread takes it from the mailbox (workers/uplink.py, workers/relay.py). Session operations go to every
worker at once and wait for their acks. Calls carry per-session step numbers, so a resent call is applied
once. Each worker reports its KV pool's figures with its acks, after a release, and in its hop record of a
forward's result (workers/kv_report.py): the pipeline's kv_bytes and pool_blocks are their latest, summed.
Runs on the controller's model thread; assignment stays on HTTP (workers/app.py).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import torch

from edgespec.model.stage import StageFailure, WireFigures
from edgespec.workers.frames import pack
from edgespec.workers.uplink import Uplinks
from edgespec.workers.wire import BatchMessage, decode, encode, encode_batch


@dataclass
class WorkerRef:
    """A worker and the layers it is assigned; of a mixture, the experts of its layers held by other workers
    (layer -> their URL -> ids) and those it holds of theirs (layer -> ids)."""

    url: str
    name: str
    first: int
    last: int
    away: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    hosted: dict[int, list[int]] = field(default_factory=dict)


class RemotePipeline(WireFigures):
    """Workers in layer order, used as one StagePipeline by the Executor."""

    def __init__(self, workers: list[WorkerRef], token: str, model: str | None, dtype: str, timeout_s: float = 60.0,
                 on_hop=None, kv_format: str = "float32"):
        self.model, self.dtype, self.kv_format = model, dtype, kv_format
        self.timeout_s = timeout_s
        self.on_hop = on_hop  # on_hop(link, bytes, stage, forward_ms): metrics
        self.http = httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=timeout_s)  # assignment
        self.links = Uplinks(token, timeout_s)
        self.steps: dict[str, int] = defaultdict(int)
        self.wire_stats: dict[str, dict[str, list[int]]] = {}
        self.replace(workers)

    def replace(self, workers: list[WorkerRef]) -> None:
        """Route through these workers from now on (after a re-plan has assigned them)."""
        self.workers = list(workers)
        names = ["controller", *(w.name for w in workers), "controller"]
        self.hop_names = [f"{a}->{b}" for a, b in itertools.pairwise(names)]

    def _step(self, session: str) -> int:
        self.steps[session] += 1
        return self.steps[session]

    def assign(self, worker: WorkerRef) -> dict:
        body = {"model": self.model, "first": worker.first, "last": worker.last, "dtype": self.dtype,
                "kv_format": self.kv_format, "away": worker.away, "hosted": worker.hosted}
        try:
            r = self.http.post(worker.url + "/assign", json=body, timeout=max(self.timeout_s, 300))
        except httpx.HTTPError as exc:
            raise StageFailure(f"worker {worker.name} is unreachable: {type(exc).__name__}: {exc}", 503) from exc
        if r.status_code != 200:
            raise StageFailure(f"worker {worker.name} answered {r.status_code}: {_message(r)}",
                               503 if r.status_code >= 500 else 502)
        return r.json()

    def _each(self, session: str, op: str, fields: dict) -> None:
        step = self._step(session)
        self.links.request([(w.name, w.url) for w in self.workers], {"op": op, "session": session, "step": step,
                                                                      **fields})

    # the Stage interface

    def open(self, session: str, capacity: int) -> None:
        step = self._step(session)
        self.wire_stats[session] = {link: [0, 0] for link in self.hop_names}
        header = {"op": "open", "session": session, "step": step, "capacity": capacity}
        for w in self.workers:
            try:
                self.links.request([(w.name, w.url)], header | {"layers": [w.first, w.last]})
            except StageFailure as exc:
                if exc.code != "not_assigned":
                    raise
                self.assign(w)  # the worker restarted: give it its layers back, then open again
                self.links.request([(w.name, w.url)], header | {"layers": [w.first, w.last]})

    def _send(self, header: dict, body: bytes, key: tuple[str, int]) -> None:
        """Start a forward or batch message at the first worker; its result will be filed under `key`."""
        first = self.workers[0]
        self.links.mailbox.expect(key, None)
        self.links.link(first.name, first.url).send(
            pack({**header, "route": [w.url for w in self.workers[1:]], "reply": self.links.controller}, body))

    def _result(self, key: tuple[str, int], shares: dict[str, float], sent: int) -> torch.Tensor:
        header, body = self.links.mailbox.take(key, self.timeout_s, f"the last stage's result for step {key[1]}")
        hops = header.get("hops", [])
        for worker, hop in zip(self.workers, hops, strict=False):  # the hops in route order: each stage's KV report
            if isinstance(hop, dict):
                self.links.reports.file(worker.name, hop)
        self._record(shares, [sent] + [h["bytes"] for h in hops], hops)
        return decode(body, ("hidden",))["hidden"]

    def forward(self, session, hidden, positions, start, mask=None):
        # hidden [B, T, H] -> hidden [B, T, H] after every worker's layers
        b, t = hidden.shape[:2]
        default = torch.arange(start, start + t).expand(b, -1)
        body = encode({"hidden": hidden, "positions": None if torch.equal(positions, default) else positions,
                       "mask": mask})
        step = self._step(session)
        self._send({"op": "forward", "session": session, "step": step, "start": start}, body, (session, step))
        return self._result((session, step), {session: 1.0}, len(body))

    def forward_batch(self, entries, hidden, positions):
        # hidden [M, H] at positions [M] -> [M, H]: every session's rows in one message per link; each session's
        # wire figures count the message once, with its share of the bytes by rows
        message = BatchMessage([(e.session, e.start, e.length, self._step(e.session)) for e in entries], hidden,
                               positions, [e.mask for e in entries])
        body = encode_batch(message)
        self._send({"op": "batch"}, body, message.key)
        return self._result(message.key, {e.session: e.length / hidden.shape[0] for e in entries}, len(body))

    def forward_segments(self, session: str, hidden: torch.Tensor, start: int, cuts: list[int]) -> torch.Tensor:
        """A pipelined prefill: hidden [1, T, H] at slots start.. cut into segments ending at `cuts` (relative,
        the last == T), all sent at once so that worker k runs segment i while worker k-1 runs i+1 (a link
        delivers in order, and workers apply a session's steps in order). Returns hidden [1, T, H]."""
        sent = []
        for a, b in itertools.pairwise([0, *cuts]):
            body = encode({"hidden": hidden[:, a:b]})
            step = self._step(session)
            self._send({"op": "forward", "session": session, "step": step, "start": start + a}, body,
                       (session, step))
            sent.append((step, len(body)))
        # In order: a failed segment raises here, before waiting for results that will not come.
        return torch.cat([self._result((session, step), {session: 1.0}, n) for step, n in sent], dim=1)

    def _record(self, shares: dict[str, float], sizes: list[int], hops: list[dict]) -> None:
        # one message per link, of these sizes; shares: each session's part of it
        for i, (link, size) in enumerate(zip(self.hop_names, sizes, strict=False)):
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
        self.wire_stats[child] = {link: [0, 0] for link in self.hop_names}

    def release(self, session: str) -> None:
        """Free the session everywhere; a worker that is down has lost it already."""
        self.steps.pop(session, None)
        self.wire_stats.pop(session, None)
        self.links.mailbox.drop(session)
        for w in self.workers:
            self.links.link(w.name, w.url).send_if_linked(pack({"op": "release", "session": session}))

    def speculate(self, session: str, epsilon: float | None) -> None:
        """Nothing speculates in the layer pipeline."""

    def figures(self, session: str) -> dict:
        return {}

    def kv_bytes(self) -> int:
        """The workers' KV bytes, as each last reported them (workers/kv_report.py)."""
        return self.links.reports.total(w.name for w in self.workers).nbytes

    def pool_blocks(self) -> tuple[int, int]:
        """The workers' pool blocks in use and free, as each last reported them with an ack, a release or a
        forward's hop record."""
        report = self.links.reports.total(w.name for w in self.workers)
        return report.used, report.free

    def close(self) -> None:
        self.links.close()
        self.http.close()


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except Exception:
        return r.text[:200]

"""HeadSplit devices on workers: one proxy per worker with the device calls of model/headsplit.py's HeadBlocks
(and `run`, the schedule from a layer on at its projection worker), and the pipeline the controller drives.

The per-step calls (attend, ffn, run) and the session operations (open, fork, commit, release) travel as frames
(workers/frames.py) on the same persistent links as the layer pipeline's: the controller's link to each worker
(workers/uplink.py) and a projection worker's links to its peers (workers/head_relay.py). A call carries an id
and is answered by an ack with that id on the same link, its tensors as the body; a refusal maps to the
exception the HTTP routes' status did (CapacityError for a full budget, StageFailure otherwise). A step's calls
carry every session's rows it runs (a batch message: workers/wire.py), so sessions that share a step share each
call. The acks of session operations carry the worker's KV figures (workers/kv_report.py). Control stays on
HTTP: assign, memory, export, reshape, placement.

The controller hands each step to the first layer's projection worker, which gathers the groups' partial
outputs from its peers, sends Z to the FFN device and goes on to the next layer, calling the controller back
only at the end or where the projection device changes (`gathered`). With `gathered=False` the controller
plays every projection device itself: two round trips per layer (the comparison's "star" variant), and so holds
the norms of the attention's output where the architecture has them (Gemma 3), read from the model's files.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import httpx
import torch

from edgespec.model.config import ModelConfig
from edgespec.model.head_blocks import StepRows, attn_out_norms
from edgespec.model.head_schedule import Part
from edgespec.model.headsplit import HeadSplitPipeline, blocks_of
from edgespec.model.kv_pool import CapacityError
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stage import StageFailure
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace
from edgespec.workers.client import WorkerRef, _message
from edgespec.workers.frames import pack
from edgespec.workers.uplink import Uplinks
from edgespec.workers.wire import BatchMessage, decode, decode_group_kv, encode, encode_batch, encode_group_kv

OCTETS = {"content-type": "application/octet-stream"}


class Call:
    """A started device call: `result()` waits for its answer and returns its tensor."""

    def __init__(self, device: LinkHeads, pending, sent: int, take: Callable[[dict, bytes], torch.Tensor]):
        self.device, self.pending, self.sent, self.take = device, pending, sent, take

    def result(self) -> torch.Tensor:
        header, body = self.pending.result()
        self.device.count(self.sent, len(body))
        return self.take(header, body)


def batch_of(rows: Sequence[StepRows], x: torch.Tensor, positions: torch.Tensor) -> bytes:
    """The sessions' rows x [M, H] at positions [M] as a batch message (workers/wire.py): each session's
    (session, start, length, step) and its mask."""
    return encode_batch(BatchMessage([(r.session, r.start, r.length, r.step) for r in rows], x, positions,
                                     [r.mask for r in rows]))


class LinkHeads:
    """One device's HeadSplit blocks reached over a link, for the schedule's calls (a HeadDevice). `send(header,
    body)` sends one call and returns what waits for its ack: `.result()` -> (header, body), or the refusal
    raised (the controller's Uplinks, or a worker's links to its peers)."""

    def __init__(self, name: str, send: Callable[[dict, bytes], Any]):
        self.name, self.send = name, send
        self.payload = [0, 0]  # tensor bytes sent and received by attend, ffn and run calls, and their count below
        self.calls = 0
        self.lock = threading.Lock()  # a worker's schedule thread and its event loop may count at once

    def count(self, sent: int, received: int) -> None:
        with self.lock:
            self.payload[0] += sent
            self.payload[1] += received
            self.calls += 1

    def _start(self, header: dict, body: bytes, take: Callable[[dict, bytes], torch.Tensor]) -> Call:
        return Call(self, self.send(header, body), len(body), take)

    def start_attend(self, layer: int, x: torch.Tensor, positions: torch.Tensor, rows: Sequence[StepRows]) -> Call:
        return self._start({"op": "attend", "layer": layer}, batch_of(rows, x, positions),
                           lambda _, out: decode(out, ("out",))["out"])

    def start_ffn(self, layer: int, z: torch.Tensor) -> Call:
        return self._start({"op": "ffn", "layer": layer}, encode({"z": z}), lambda _, out: decode(out, ("x",))["x"])


class RemoteHeads(LinkHeads):
    """One worker's HeadSplit blocks, driven by the controller (a GatheringDevice): the per-step calls and
    session operations on its link, control over HTTP; its caches' figures as it last reported them with its
    acks (workers/kv_report.py)."""

    def __init__(self, http: httpx.Client, links: Uplinks, worker: WorkerRef):
        super().__init__(worker.name, lambda header, body: links.start(worker.name, worker.url, header, body))
        self.http, self.links, self.worker = http, links, worker

    def open(self, session: str, capacity: int) -> None:
        self.send({"op": "head_open", "session": session, "capacity": capacity}, b"").result()

    def fork(self, session: str, child: str, length: int, capacity: int, step: int) -> None:
        self.send({"op": "head_fork", "session": session, "child": child, "prefix_len": length,
                   "capacity": capacity, "step": step}, b"").result()

    def commit(self, session: str, kept: list[int], dest: int, step: int) -> None:
        self.send({"op": "head_commit", "session": session, "kept": kept, "dest": dest, "step": step},
                  b"").result()

    def kv_bytes(self) -> int:
        return self.links.reports.latest(self.name).nbytes

    def pool_blocks(self) -> tuple[int, int]:
        report = self.links.reports.latest(self.name)
        return report.used, report.free

    def run(self, parts: Sequence[Part], first: int, x: torch.Tensor, positions: torch.Tensor,
            wire: dict[str, dict[str, list[int]]]) -> tuple[torch.Tensor, int]:
        """Layers first.. at this projection worker for the parts' rows x [M, H] -> (the last one's output
        [M, H], the next layer to run); the speculation counts add to each part's stats, and the traffic (its
        own and to its peers) to each session's wire (link -> [bytes, requests]), its share of the bytes by
        rows."""
        body = batch_of([p.rows for p in parts], x, positions)
        header = {"op": "run", "layer": first, "epsilons": [p.epsilon for p in parts]}
        answer, out = self.send(header, body).result()
        self.count(len(body), len(out))
        for part, kept, discarded in zip(parts, answer["kept"], answer["discarded"], strict=True):
            for i, (k, d) in enumerate(zip(kept, discarded, strict=True)):
                part.stats.kept[i] += k
                part.stats.discarded[i] += d
        for part in parts:
            share = part.rows.length / x.shape[0]
            for link, b, n in ((f"controller-{self.name}", len(body) + len(out), 1),
                               (f"{self.name}-peers", *answer["wire"])):
                tally = wire.setdefault(part.rows.session, {}).setdefault(link, [0, 0])
                tally[0] += round(b * share)
                tally[1] += n
        return decode(out, ("x",))["x"], int(answer["next"])

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            r = self.http.request(method, self.worker.url + path, **kwargs)
        except httpx.HTTPError as exc:
            raise StageFailure(f"worker {self.worker.name} is unreachable: {type(exc).__name__}: {exc}", 503) from exc
        if r.status_code == 507:  # the worker's memory budget is full: the same error as in-process
            raise CapacityError(f"worker {self.worker.name}: {_message(r)}")
        if r.status_code != 200:
            raise StageFailure(f"worker {self.worker.name} answered {r.status_code}: {_message(r)}",
                               503 if r.status_code >= 500 else 502)
        return r

    def release(self, session: str) -> None:
        """Free the session there if the link is up; a worker without a link to this controller may be down, and
        one that restarted has lost the session anyway."""
        self.links.link(self.worker.name, self.worker.url).send_if_linked(
            pack({"op": "head_release", "session": session}))

    def assign(self, groups: dict[int, list[int]], ffns: list[int], dtype: str, model: str | None,
               name: str | None = None, placement: list[dict] | None = None, peers: dict[str, str] | None = None,
               kv_format: str = "float32") -> dict:
        body = {"model": model, "groups": {str(k): v for k, v in groups.items()}, "ffns": ffns, "dtype": dtype,
                "name": name, "placement": placement, "peers": peers or {}, "kv_format": kv_format}
        return self._call("POST", "/heads/assign", json=body, timeout=300).json()

    def memory_bytes(self) -> int:
        return int(self._call("GET", "/heads/memory").json()["used_bytes"])

    def export(self, groups: dict[int, list[int]]) -> dict:
        r = self._call("POST", "/heads/export", json={"groups": {str(k): v for k, v in groups.items()}}, timeout=300)
        return decode_group_kv(r.content)

    def reshape(self, groups: dict[int, list[int]], ffns: list[int], incoming: dict) -> None:
        blocks = json.dumps({"groups": {str(k): v for k, v in groups.items()}, "ffns": ffns})
        self._call("POST", "/heads/reshape", content=encode_group_kv(incoming), timeout=300,
                   headers={**OCTETS, "x-blocks": blocks})

    def set_placement(self, layers: list[LayerPlace]) -> None:
        self._call("POST", "/heads/placement", json=[asdict(lp) for lp in layers])


def remote_headsplit(workers: dict[str, str], token: str, layers: list[LayerPlace], cfg: ModelConfig,
                     dtype: str = "float32", model: str | None = None, epsilon: float = 0.05,
                     timeout_s: float = 60.0, gathered: bool = True, kv_format: str = "float32") -> HeadSplitPipeline:
    """Assign each worker (name -> URL) its blocks of the placement, and with `gathered` the placement and its
    peers' URLs, and return the pipeline over them (its per-step calls on links, one per worker). Without
    `gathered`, the norms of the attention's output (where the architecture has them) are read here from
    `model` (None: the default model, as a worker without --model resolves it)."""
    attn_out = None
    if not gathered and "attn_out" in cfg.arch.norms:
        attn_out = attn_out_norms(open_source(resolve_model(model)), cfg, weight_format(dtype))
    http = httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=timeout_s,
                        transport=httpx.HTTPTransport(retries=1))
    links = Uplinks(token, timeout_s)
    devices = {name: RemoteHeads(http, links, WorkerRef(url.rstrip("/"), name, 0, 0)) for name, url in workers.items()}

    def close() -> None:
        links.close()
        http.close()

    placement = [asdict(lp) for lp in layers] if gathered else None
    try:
        for name, device in devices.items():
            device.assign(*blocks_of(layers, name), dtype, model, name, placement, workers if gathered else {},
                          kv_format)
    except Exception:
        close()
        raise
    return HeadSplitPipeline(devices, layers, cfg, epsilon, close, gathered, attn_out)


def call_ms(url: str, token: str, nbytes: int, n: int = 50) -> float:
    """Median time of a call on a controller's link to a worker besides the compute: a ping frame carrying
    `nbytes` (a token's hidden state) out and its pong back, on a link like the one HeadSplit's calls take."""
    links = Uplinks(token, 60.0)
    link, body, times = links.link("probe", url.rstrip("/")), b"\0" * nbytes, []
    try:
        for i in range(n + 1):  # the first dials the link and warms both ends
            mid = next(links.ids)
            t0 = time.perf_counter()
            links.mailbox.expect(mid, "probe")
            link.send(pack({"op": "ping", "id": mid}, body))
            links.mailbox.take(mid, 60.0, "the worker's pong")
            if i:
                times.append(1000 * (time.perf_counter() - t0))
    finally:
        links.close()
    return statistics.median(times)

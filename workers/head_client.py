"""HeadSplit devices over HTTP: one proxy per worker with the device calls of model/headsplit.py's HeadBlocks
(and `run`, the schedule from a layer on at its projection worker), and the pipeline the controller drives.

The controller hands each step to the first layer's projection worker, which gathers the groups' partial
outputs from its peers, sends Z to the FFN device and goes on to the next layer, calling the controller back
only at the end or where the projection device changes (`gathered`). With `gathered=False` the controller
plays every projection device itself: two round trips per layer (the comparison's "star" variant).
"""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import httpx
import torch

from edgespec.model.config import ModelConfig
from edgespec.model.headsplit import HeadSplitPipeline, SpeculationStats, blocks_of
from edgespec.model.kv_pool import CapacityError
from edgespec.model.stage import StageFailure
from edgespec.planning.headsplit import LayerPlace
from edgespec.workers.client import WorkerRef, _message
from edgespec.workers.wire import decode, decode_group_kv, encode, encode_group_kv

OCTETS = {"content-type": "application/octet-stream"}
# a call may be written as headers, then body: with Nagle's algorithm on, the small second write can wait for
# the peer's delayed ACK (a round trip per call on a real link)
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


class RemoteHeads:
    """One worker's HeadSplit blocks, driven over HTTP."""

    def __init__(self, http: httpx.Client, worker: WorkerRef):
        self.http, self.worker = http, worker
        self.payload = [0, 0]  # tensor bytes sent and received by attend and ffn calls, and their count below
        self.calls = 0
        self.lock = threading.Lock()  # an FFN call and a speculative attend call may run at once

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

    def assign(self, groups: dict[int, list[int]], ffns: list[int], dtype: str, model: str | None,
               name: str | None = None, placement: list[dict] | None = None, peers: dict[str, str] | None = None
               ) -> dict:
        body = {"model": model, "groups": {str(k): v for k, v in groups.items()}, "ffns": ffns, "dtype": dtype,
                "name": name, "placement": placement, "peers": peers or {}}
        return self._call("POST", "/heads/assign", json=body, timeout=300).json()

    def open(self, session: str, capacity: int) -> None:
        self._call("POST", f"/heads/sessions/{session}/open", json={"capacity": capacity})

    def release(self, session: str) -> None:
        self._call("DELETE", f"/heads/sessions/{session}")

    def attend(self, session: str, layer: int, x: torch.Tensor, positions: torch.Tensor, start: int,
               mask: torch.Tensor | None, step: int) -> torch.Tensor:
        body = encode({"x": x, "positions": positions, "mask": mask})
        r = self._call("POST", f"/heads/sessions/{session}/attend", content=body, headers=OCTETS,
                       params={"layer": layer, "start": start, "step": step})
        self._count(body, r)
        return decode(r.content, ("out",))["out"]

    def _count(self, body: bytes, r: httpx.Response) -> None:
        with self.lock:
            self.payload[0] += len(body)
            self.payload[1] += len(r.content)
            self.calls += 1

    def feed_forward(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        body = encode({"z": z})
        r = self._call("POST", "/heads/ffn", params={"layer": layer}, content=body, headers=OCTETS)
        self._count(body, r)
        return decode(r.content, ("x",))["x"]

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

    def run(self, session: str, first: int, x: torch.Tensor, positions: torch.Tensor, start: int,
            mask: torch.Tensor | None, epsilon: float, stats: SpeculationStats, step: int,
            wire: dict[str, list[int]]) -> tuple[torch.Tensor, int]:
        """Layers first.. at this projection worker -> (the last one's output, the next layer to run); its
        speculation counts add to stats, and its traffic and its peers' to wire (link -> [bytes, requests])."""
        body = encode({"x": x, "positions": positions, "mask": mask})
        r = self._call("POST", f"/heads/sessions/{session}/run", content=body, headers=OCTETS,
                       params={"layer": first, "start": start, "epsilon": repr(epsilon), "step": step})
        self._count(body, r)
        out = decode(r.content, ("x", "next", "kept", "discarded", "wire"))
        for i, (k, d) in enumerate(zip(out["kept"].tolist(), out["discarded"].tolist(), strict=True)):
            stats.kept[i] += k
            stats.discarded[i] += d
        for link, b, n in ((f"controller-{self.worker.name}", len(body) + len(r.content), 1),
                           (f"{self.worker.name}-peers", *out["wire"].tolist())):
            tally = wire.setdefault(link, [0, 0])
            tally[0] += b
            tally[1] += n
        return out["x"], int(out["next"])


class Reach:
    """An HTTP client with the cluster's token and a thread pool, to drive HeadSplit devices on workers."""

    def __init__(self, token: str, threads: int, timeout_s: float = 60.0):
        self.http = httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=timeout_s,
                                 transport=httpx.HTTPTransport(retries=1, socket_options=NODELAY))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="heads")

    def device(self, name: str, url: str) -> RemoteHeads:
        return RemoteHeads(self.http, WorkerRef(url.rstrip("/"), name, 0, 0))

    def fan_out(self, fns: list) -> list:
        """Run the calls at once; their results in order."""
        return list(self.pool.map(lambda fn: fn(), fns))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def remote_headsplit(workers: dict[str, str], token: str, layers: list[LayerPlace], cfg: ModelConfig,
                     dtype: str = "float32", model: str | None = None, epsilon: float = 0.05,
                     timeout_s: float = 60.0, gathered: bool = True) -> HeadSplitPipeline:
    """Assign each worker (name -> URL) its blocks of the placement, and with `gathered` the placement and its
    peers' URLs, and return the pipeline over them."""
    reach = Reach(token, len(workers) + 1, timeout_s)  # an FFN call beside every device's
    devices = {name: reach.device(name, url) for name, url in workers.items()}
    placement = [asdict(lp) for lp in layers] if gathered else None
    for name, device in devices.items():
        device.assign(*blocks_of(layers, name), dtype, model, name, placement, workers if gathered else {})
    return HeadSplitPipeline(devices, layers, cfg, epsilon, reach.fan_out, reach.close, gathered)

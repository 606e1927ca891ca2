"""The controller's side of HeadSplit over workers (issue 9, in progress): one proxy per worker with the device
calls of model/headsplit.py's HeadBlocks, and a HeadSplitPipeline over them whose concurrent calls (a layer's
group calls; at a speculating layer, those and the previous layer's FFN) go out at once.

For now the controller gathers each layer's partial outputs itself (it plays the projection device) and sends
Z to the FFN device: two round trips per layer. Gathering at a projection worker that forwards Z on, without
the controller in between, is the next step.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from model.config import ModelConfig
from model.headsplit import HeadSplitPipeline, blocks_of
from planning.headsplit import LayerPlace
from workers.client import NODELAY, StageFailure, WorkerRef, _message
from workers.wire import decode, encode

OCTETS = {"content-type": "application/octet-stream"}


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
        if r.status_code != 200:
            raise StageFailure(f"worker {self.worker.name} answered {r.status_code}: {_message(r)}",
                               503 if r.status_code >= 500 else 502)
        return r

    def assign(self, groups: dict[int, list[int]], ffns: list[int], dtype: str, model: str | None) -> dict:
        body = {"model": model, "groups": {str(k): v for k, v in groups.items()}, "ffns": ffns, "dtype": dtype}
        return self._call("POST", "/heads/assign", json=body, timeout=300).json()

    def open(self, session: str, capacity: int, rows: int = 1) -> None:
        self._call("POST", f"/heads/sessions/{session}/open", json={"capacity": capacity, "rows": rows})

    def release(self, session: str) -> None:
        self._call("DELETE", f"/heads/sessions/{session}")

    def truncate(self, session: str, length: int) -> None:
        self._call("POST", f"/heads/sessions/{session}/truncate", json={"length": length})

    def attend(self, session: str, layer: int, x: torch.Tensor, positions: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        body = encode({"x": x, "positions": positions, "mask": mask})
        r = self._call("POST", f"/heads/sessions/{session}/attend", params={"layer": layer, "start": start},
                       content=body, headers=OCTETS)
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


def remote_headsplit(workers: dict[str, str], token: str, layers: list[LayerPlace], cfg: ModelConfig,
                     dtype: str = "float32", model: str | None = None, epsilon: float = 0.05,
                     timeout_s: float = 60.0) -> HeadSplitPipeline:
    """Assign each worker (name -> URL) its blocks of the placement and return the pipeline over them."""
    http = httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=timeout_s,
                        transport=httpx.HTTPTransport(retries=1, socket_options=NODELAY))
    devices = {name: RemoteHeads(http, WorkerRef(url.rstrip("/"), name, 0, 0)) for name, url in workers.items()}
    for name, device in devices.items():
        device.assign(*blocks_of(layers, name), dtype, model)
    pool = ThreadPoolExecutor(len(devices) + 1, thread_name_prefix="heads")  # an FFN call beside every device's

    def close() -> None:
        pool.shutdown(wait=False, cancel_futures=True)
        http.close()

    return HeadSplitPipeline(devices, layers, cfg, epsilon, lambda fns: list(pool.map(lambda fn: fn(), fns)), close)

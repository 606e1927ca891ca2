"""What a hop costs: one-token steps through N local workers driven directly (no API, no sampling), each step's
wall time against the stages' own compute (the forward_ms each stage reports), and the layers' compute in this
process for comparison.

    python -m edgespec.bench.hops --workers 1,2,4 --out DIR

Per setup: the median step, the median sum of the stages' compute, and (step - compute) / links, the cost of
one message on a link with the controller's hand-offs. Writes DIR/hops.json. Measure alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from edgespec.model.config import ModelConfig
from edgespec.model.source import resolve_model
from edgespec.workers.client import RemotePipeline, WorkerRef
from edgespec.workers.cluster import launch_local_workers, wait_healthy
from edgespec.workers.host import StageHost
from edgespec.workers.settings import WorkerSettings
from edgespec.workers.wire import encode

STEPS, SKIP = 300, 50  # steps per setup (contexts 0..299), the first ones left out of the medians


def over_workers(n: int, dtype: str, threads: int) -> dict:
    cfg = ModelConfig.from_folder(resolve_model(None).folder)
    cluster = launch_local_workers(n, None, threads)
    try:
        asyncio.run(wait_healthy(cluster, 120))
        per = cfg.n_layers // n
        refs = [WorkerRef(w.url, w.name, i * per, cfg.n_layers if i == n - 1 else (i + 1) * per)
                for i, w in enumerate(cluster.workers)]
        hops: list[float] = []
        pipe = RemotePipeline(refs, cluster.token, None, dtype, 60, on_hop=lambda _l, _b, _s, ms: hops.append(ms))
        for ref in refs:
            pipe.assign(ref)
        pipe.open("s", 1024)
        hidden = torch.randn(1, 1, cfg.hidden_size)
        walls, computes = [], []
        for i in range(STEPS):
            hops.clear()
            t0 = time.perf_counter()
            pipe.forward("s", hidden, torch.tensor([[i]]), i)
            walls.append(1000 * (time.perf_counter() - t0))
            computes.append(sum(ms for ms in hops if ms))
        pipe.close()
    finally:
        cluster.stop()
    step, compute = statistics.median(walls[SKIP:]), statistics.median(computes[SKIP:])
    return {"workers": n, "step_ms": round(step, 3), "stages_compute_ms": round(compute, 3),
            "per_link_ms": round((step - compute) / (n + 1), 3)}


def in_process(dtype: str, threads: int, layers: int) -> float:
    """Median ms of `layers` layers' forward here, through the worker's own StageHost (decode, compute, encode)."""
    torch.set_num_threads(threads)
    host = StageHost(WorkerSettings(port=1, token="bench", threads=threads, adapt_threads=False))
    host.assign(None, 0, layers, dtype)
    host.open("s", 1, 1024)
    times = []
    for i in range(STEPS):
        body = encode({"hidden": torch.randn(1, 1, host.cfg.hidden_size)})
        t0 = time.perf_counter()
        host.forward("s", i + 2, i, body)
        times.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(times[SKIP:]), 3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each worker and of this process")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    n_layers = ModelConfig.from_folder(resolve_model(None).folder).n_layers
    result = {"settings": vars(args) | {"steps": STEPS, "skip": SKIP},
              "setups": [over_workers(n, args.dtype, args.threads) for n in counts],
              "in_process_stage_ms": {str(n_layers // n): in_process(args.dtype, args.threads, n_layers // n)
                                      for n in sorted(set(counts))}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hops.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

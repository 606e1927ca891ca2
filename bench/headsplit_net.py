"""compare-headsplit's settings (bench/headsplit.py): where the workers run and how they are reached, and what
the simulator needs to predict the same setting (this machine's block times for the model's shape).

- Loopback: workers on 127.0.0.1 started as today (`serve --local-workers N` for the layer pipeline,
  workers/cluster.py's launch_local_workers for the head modes).
- Shaped: every worker in a network namespace of its own on bench/netem.py's Lan, its veth shaped in both
  directions (tbf at the link's rate; netem delay where the kernel has it); this process (the head modes'
  controller) and the layer-based `edgespec serve` stay in the root namespace, joined to the bridge by a veth
  shaped the same way, so that every message between two devices crosses two shaped egresses each way. A
  link's round trip is therefore four per-egress delays: a link of round trip R gets R/4 on each.
Workers are pinned one per core where there are cores enough (worker i on CPU i mod cores), one torch thread
each, in both settings.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

from edgespec.bench.distributed import start
from edgespec.bench.netem import Lan, netns_problem, spawn, stop
from edgespec.model.config import ModelConfig
from edgespec.model.drift import time_blocks
from edgespec.model.headsplit import HeadSplitPipeline
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.timing import median_ms, time_layers
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace
from edgespec.planning.testbeds import load_specs
from edgespec.workers.cluster import launch_local_workers, wait_healthy

PREFIX, SUBNET, PORT = "eshs", "10.233.0", 9100  # apart from bench/netem (es, .231) and its test (esdisc, .232)
ROOT_ADDRESS = f"{SUBNET}.2"


def worker_cpus(n: int) -> list[int]:
    """Worker i's CPU: one per core where there are enough, else round the cores again (they then share)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i % len(cores)] for i in range(n)]


@dataclass(frozen=True)
class LinkSpec:
    """A shaped link: the tc rate of each egress, the netem delay of each egress, and what it stands for."""

    name: str
    rate: str  # tc rate, e.g. "200mbit"
    delay_ms: float  # per shaped egress (a device-to-device round trip crosses four)
    rtt_ms: float  # the round trip it stands for (config/devices.toml), or 4 x delay_ms
    bandwidth_mbit_s: float


def link_spec(name: str | None, rate: str | None, delay_ms: float | None) -> LinkSpec | None:
    """A named link of config/devices.toml ([links.NAME]: rtt_ms, bandwidth_mbit_s), with --rate / --delay-ms
    overriding it; None (loopback) when neither a name nor a rate is given."""
    if name is None and rate is None:
        if delay_ms is not None:
            raise ValueError("--delay-ms shapes links: give --link or --rate too")
        return None
    spec = load_specs()["links"].get(name, {}) if name else {}
    if name and not spec:
        raise ValueError(f"no link {name!r} in config/devices.toml")
    mbit = spec.get("bandwidth_mbit_s")
    rate = rate or f"{mbit:g}mbit"
    if mbit is None:
        mbit = tc_mbit(rate)
    delay = delay_ms if delay_ms is not None else spec.get("rtt_ms", 0.0) / 4
    return LinkSpec(name or "custom", rate, delay, spec.get("rtt_ms", 4 * delay), mbit)


def tc_mbit(rate: str) -> float:
    """A tc rate string in Mbit/s (kbit, mbit, gbit, or bits)."""
    units = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "bit": 1e-6}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    return float(rate) * 1e-6


@dataclass
class Workers:
    """Running workers for the head modes: name -> URL, their token, and how to stop them."""

    urls: dict[str, str]
    token: str
    stop: object  # () -> None


class Loopback:
    """Workers on loopback (as compare-headsplit always did)."""

    name = "loopback"

    def __init__(self, out: Path):
        self.out, self.notes = out, []

    def layer_server(self, n: int, serve_args: list[str], log: Path):
        cpus = ";".join(str(c) for c in worker_cpus(n))
        return start(["--local-workers", str(n), "--worker-cpus", cpus, "--worker-threads", "1", *serve_args], log)

    def head_workers(self, n: int, model: str | None) -> Workers:
        config = launch_local_workers(n, model, 1, ";".join(str(c) for c in worker_cpus(n)))
        try:
            asyncio.run(wait_healthy(config, 300))
        except BaseException:
            config.stop()
            raise
        return Workers({w.name: w.url for w in config.workers}, config.token, config.stop)

    def close(self) -> None:
        pass


class Shaped:
    """Workers in network namespaces on shaped links (see the module docstring); one Lan per worker count, made
    at the first call for that count and always torn down by close()."""

    name = "namespaces"

    def __init__(self, out: Path, link: LinkSpec):
        problem = netns_problem(PREFIX)
        if problem:
            raise RuntimeError(f"--link needs network namespaces (root): {problem}")
        self.out, self.link, self.lan, self.n = out, link, None, 0
        self.notes: list[str] = []

    def _lan(self, n: int) -> Lan:
        if self.lan is None or self.n != n:
            self.close()
            self.lan, self.n = Lan([f"w{i}" for i in range(n)], self.link.rate, self.link.delay_ms, PREFIX, SUBNET), n
            self.lan.down()  # leftovers of an interrupted run
            self.lan.up()
            self.lan.join_root(ROOT_ADDRESS, shaped=True)
            self.notes = [*dict.fromkeys([*self.notes, *self.lan.notes])]
        return self.lan

    def _spawn(self, n: int, model: str | None, what: str) -> tuple[dict[str, str], str, list[subprocess.Popen]]:
        lan, token, procs = self._lan(n), secrets.token_urlsafe(24), []
        urls = {f"w{i}": f"http://{lan.ip(f'w{i}')}:{PORT}" for i in range(n)}
        try:
            for name, cpu in zip(urls, worker_cpus(n), strict=True):
                args = ["worker", "--host", lan.ip(name), "--port", str(PORT), f"--token={token}", "--name", name,
                        "--threads", "1", "--no-adapt-threads", *(["--model", model] if model else [])]
                procs.append(spawn(lan.ns(name), args, self.out / f"{what}-{n}-{name}.log", {cpu}))
            wait_up(list(urls.values()), procs, 300)
        except BaseException:
            stop(procs)
            raise
        return urls, token, procs

    def layer_server(self, n: int, serve_args: list[str], log: Path):
        model = serve_args[serve_args.index("--model") + 1] if "--model" in serve_args else None
        urls, token, procs = self._spawn(n, model, "layer-worker")
        cluster = self.out / f"cluster-{n}.toml"
        lines = [f'token = "{token}"']
        for name, url in urls.items():
            lines += ["[[workers]]", f'url = "{url}"', f'name = "{name}"']
        cluster.write_text("\n".join(lines) + "\n")
        try:
            proc, url = start(["--cluster", str(cluster), *serve_args], log)
        except BaseException:
            stop(procs)
            raise
        return _WithWorkers(proc, procs), url

    def head_workers(self, n: int, model: str | None) -> Workers:
        urls, token, procs = self._spawn(n, model, "head-worker")
        return Workers(urls, token, lambda: stop(procs))

    def close(self) -> None:
        if self.lan is not None:
            self.lan.down()
            self.lan = None


class _WithWorkers:
    """The layer server's process, whose terminate() and wait() also stop the workers started for it."""

    def __init__(self, proc: subprocess.Popen, workers: list[subprocess.Popen]):
        self.proc, self.workers = proc, workers

    def terminate(self) -> None:
        self.proc.terminate()

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        finally:
            stop(self.workers)


def wait_up(urls: list[str], procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Until every URL answers /health (a worker that exits first: RuntimeError, its log says why)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(urls)
    while waiting:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker exited during start-up; see its log in the output folder")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{', '.join(waiting)} not healthy after {timeout_s} s")
        try:
            if httpx.get(waiting[0] + "/health", timeout=2).status_code == 200:
                waiting.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def setting(out: Path, link: LinkSpec | None) -> Loopback | Shaped:
    return Loopback(out) if link is None else Shaped(out, link)


@torch.inference_mode()
def measure_blocks(folder: Path, cfg: ModelConfig, ends: TokenEnds, prompt: list[int], tokens: int,
                   reps: int = 40) -> dict:
    """This machine's times for the model, what the simulator is fed, on one thread as each worker runs:
    - the head modes' blocks as the workers run them: every block on one device in this process (model/
      headsplit.py's schedule over model/head_blocks.py, no link), decoding greedily from the prompt for up to
      `tokens` tokens; per token, the KV groups' attention (group_ms: per layer and group), the FFNs (ffn_ms:
      per layer) and the rest of the schedule (proj_ms: per layer, the gathering and its bookkeeping), medians
      over the tokens. Over the whole model, as a token streams every layer's weights from memory: one block
      timed alone again and again (profile-headsplit's time_blocks, `isolated_block_ms`) keeps its weights in
      cache, which on a machine with a large L3 is much faster than decoding;
    - a whole layer as the layer pipeline runs it (layer_ms), over every layer of the model;
    - the controller's embedding, head and argmax of one token (ends_ms), on this process's threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = open_source(folder)
    try:
        steps = _head_steps(src, cfg, ends, prompt, max(2, min(tokens, 32)))
        context = len(prompt) + len(steps) // 2
        isolated = time_blocks(LayerStack.load(src, cfg, 0, 1, torch.bfloat16), context, reps)
        stack = LayerStack.load(src, cfg, 0, cfg.n_layers, torch.bfloat16)
        layer = time_layers(stack, [1], [context], 5).ms[0][0]
        del stack
    finally:
        torch.set_num_threads(threads)
    ids = torch.tensor([[1]])
    ends_ms = median_ms(lambda: int(ends.logits(ends.embed_tokens(ids))[0, -1].argmax()), reps)
    total, attend, ffn = (1000 * statistics.median(s[i] for s in steps) for i in range(3))
    n, g = cfg.n_layers, cfg.n_kv_heads
    return {"group_ms": round(attend / (n * g), 4), "proj_ms": round((total - attend - ffn) / n, 4),
            "ffn_ms": round(ffn / n, 4), "layer_ms": round(layer, 4), "ends_ms": round(ends_ms, 4),
            "in_process_ms_per_token": round(total, 3), "context": context, "threads": 1,
            "isolated_block_ms": {k: round(v, 4) for k, v in isolated.items()}}


def _head_steps(src, cfg: ModelConfig, ends: TokenEnds, prompt: list[int], tokens: int) -> list[tuple]:
    """(total, attention, FFN) seconds of each decoding token with every head block on one device here."""
    layers = [LayerPlace({"local": list(range(cfg.n_kv_heads))}, "local", "local") for _ in range(cfg.n_layers)]
    pipe = HeadSplitPipeline.local(src, cfg, torch.bfloat16, layers, 0.0)
    device, spent = pipe.devices["local"], [0.0, 0.0]

    def timed(i: int, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[i] += time.perf_counter() - t0
        return call

    device.attend, device.feed_forward = timed(0, device.attend), timed(1, device.feed_forward)
    pipe.open("blocks", len(prompt) + tokens + 1)
    hidden = pipe.forward("blocks", ends.embed_tokens(torch.tensor([prompt])), torch.arange(len(prompt))[None], 0)
    token, steps = int(ends.logits(hidden[:, -1:])[0, -1].argmax()), []
    for p in range(len(prompt), len(prompt) + tokens - 1):
        x = ends.embed_tokens(torch.tensor([[token]]))
        spent[:] = [0.0, 0.0]
        t0 = time.perf_counter()
        hidden = pipe.forward("blocks", x, torch.tensor([[p]]), p)
        steps.append((time.perf_counter() - t0, *spent))
        token = int(ends.logits(hidden)[0, -1].argmax())
    pipe.release("blocks")
    pipe.close()
    return steps


def overtakes(by_workers: dict) -> dict:
    """Per mode, the worker counts at which it is faster than layer-based (speedup > 1), measured and
    predicted."""
    out: dict[str, dict[str, list[int]]] = {}
    for n, row in by_workers.items():
        for label, r in row["modes"].items():
            if label == "layer":
                continue
            entry = out.setdefault(label, {"measured": [], "predicted": []})
            if r.get("speedup_over_layer", 0) > 1:
                entry["measured"].append(int(n))
            if r.get("predicted_speedup_over_layer", 0) > 1:
                entry["predicted"].append(int(n))
            if "predicted_with_link_rtt_speedup_over_layer" in r:
                entry.setdefault("predicted_with_link_rtt", [])
                if r["predicted_with_link_rtt_speedup_over_layer"] > 1:
                    entry["predicted_with_link_rtt"].append(int(n))
    return out


def speedup_chart(path: Path, title: str, by_workers: dict) -> None:
    """Speedup over layer-based against worker count, per mode: measured (solid) and predicted (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [int(n) for n in by_workers]
    labels = [label for label in next(iter(by_workers.values()))["modes"] if label != "layer"]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    for i, label in enumerate(labels):
        color = f"C{i}"
        for key, style, what in (("speedup_over_layer", "-o", "measured"),
                                 ("predicted_speedup_over_layer", "--x", "predicted"),
                                 ("predicted_with_link_rtt_speedup_over_layer", ":+", "predicted, link's rtt")):
            ys = [by_workers[str(n)]["modes"].get(label, {}).get(key) for n in counts]
            if all(y is not None for y in ys):
                ax.plot(counts, ys, style, color=color, label=f"{label} ({what})")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(counts)
    ax.set_xlabel("workers")
    ax.set_ylabel("speedup over layer-based")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(by_workers: dict, over: dict) -> None:
    table = Table("n", "mode", "ms/token", "predicted", "speedup", "predicted", "B/token", "calls/token", "kept",
                  "discarded", "ppl change")
    for n, row in by_workers.items():
        for label, r in row["modes"].items():
            change = r.get("perplexity_change")
            table.add_row(n, label, f"{r['median_ms_per_token']:.1f}", str(r.get("predicted_ms_per_token", "")),
                          str(r.get("speedup_over_layer", "")), str(r.get("predicted_speedup_over_layer", "")),
                          f"{r['payload_bytes_per_token']:.0f}", f"{r['calls_per_token']:.2f}",
                          str(r.get("speculations_kept", "")), str(r.get("speculations_discarded", "")),
                          "" if change is None else f"{change:+.4%}")
    console = Console(width=160)
    console.print(table)
    for label, e in over.items():
        console.print(f"{label}: faster than layer-based at {e['measured'] or 'no'} worker count(s) measured, "
                      f"{e['predicted'] or 'no'} predicted"
                      + (f", {e['predicted_with_link_rtt'] or 'no'} predicted with the link's round trip"
                         if "predicted_with_link_rtt" in e else ""))

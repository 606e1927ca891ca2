"""The controller's view of its workers: the cluster file, local worker processes, assignment, health."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class WorkerSpec:
    url: str
    name: str | None = None
    memory_budget_gib: float | None = None


@dataclass
class ClusterConfig:
    """What a cluster file says: the shared token and the workers in pipeline order."""

    token: str
    workers: list[WorkerSpec]
    processes: list[subprocess.Popen] = field(default_factory=list)  # local workers we started
    respawn: Callable[[int], None] | None = None  # restart local worker i on a fresh port

    @classmethod
    def from_file(cls, path: Path) -> ClusterConfig:
        data = tomllib.loads(Path(path).read_text())
        if not data.get("token"):
            raise ValueError(f"{path}: 'token' (the cluster's shared token) is required")
        workers = [WorkerSpec(**w) for w in data.get("workers", [])]
        if not workers:
            raise ValueError(f"{path}: at least one [[workers]] entry with a url is required")
        return cls(data["token"], workers)

    def stop(self) -> None:
        """Stop the local workers we started (idempotent)."""
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int, avoid: int | None = None) -> list[int]:
    """n distinct ports free on loopback now. The sockets are held until all n are found: two ports asked for
    one after the other can be the same (the first was free again once closed). That happened: two local
    workers were given one port, the second failed to bind, both URLs reached the first worker, and a
    re-assignment of "worker1" moved worker0's layers ("this worker holds layers [2, 4), not [0, 2]", 409)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)  # an avoided port is held too, so that it is not found again
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] != avoid:
                ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


def worker_command(port: int, token: str, name: str, model: str | None, threads: int,
                   prefault: bool = False, adapt: bool = True, budget_gib: float | None = None) -> list[str]:
    # --token=VALUE: a random token may start with "-", which argparse would take for an option
    cmd = [sys.executable, "-m", "edgespec.server.cli", "worker", "--host", "127.0.0.1", "--port", str(port),
           f"--token={token}", "--name", name, "--threads", str(threads)]
    return (cmd + (["--model", model] if model else []) + (["--kv-prefault"] if prefault else [])
            + ([] if adapt else ["--no-adapt-threads"])
            + ([] if budget_gib is None else ["--memory-budget-gib", str(budget_gib)]))


def parse_ranges(spec: str) -> set[int]:
    """'0-11,28-29' -> {0, 1, ..., 11, 28, 29}."""
    out: set[int] = set()
    for item in spec.split(","):
        lo, _, hi = item.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"ranges look like '0-3,7', got {spec!r}")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def parse_cpu_sets(spec: str | None, n: int) -> list[set[int] | None]:
    """'0;1' or '0,1;2-3' -> a CPU set per worker (the last set repeats); None: unpinned."""
    if not spec:
        return [None] * n
    sets = [parse_ranges(part) for part in spec.split(";")]
    return [sets[min(i, len(sets) - 1)] for i in range(n)]


def _child_setup(cpus: set[int] | None):
    def setup() -> None:
        """In the child before exec: get SIGTERM when the controller dies, however it dies (Linux); pin."""
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def launch_local_workers(n: int, model: str | None, threads: int, cpus: str | None = None,
                         avoid: int | None = None, prefault: bool = False,
                         budget_gib: float | None = None) -> ClusterConfig:
    """Start n worker processes on loopback with a fresh random token, pinned to CPU sets if given; `avoid`:
    the controller's own port, free still while it loads (a worker that took it once kept it from serving);
    `budget_gib`: each worker's memory budget (None: the worker's default)."""
    token = secrets.token_urlsafe(24)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cpu_sets = parse_cpu_sets(cpus, n)

    def spawn(i: int, port: int | None = None) -> tuple[subprocess.Popen, WorkerSpec]:
        # a port found free can be taken before the worker binds it: wait_healthy respawns on a new one
        port, name = port or free_ports(1, avoid)[0], f"worker{i}"
        # Several local workers take turns on the same cores by design: each one's wait for another, at every
        # hand-off, reads as contention to its thread governor (model/cpu_share.py), which dropped all 4 workers
        # to one thread (bench/distributed in two runs: 4 workers 0.460x of in-process with it, 0.511x without;
        # 2 workers 0.627x and 0.683x). A single local worker keeps it, for others' busy cores (bench/busy.py).
        command = worker_command(port, token, name, model, threads, prefault, adapt=n == 1, budget_gib=budget_gib)
        # output goes to the controller's own stderr, so a worker that fails to start says why
        process = subprocess.Popen(command, stdout=sys.stderr, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=_child_setup(cpu_sets[i]))
        return process, WorkerSpec(f"http://127.0.0.1:{port}", name, budget_gib)

    def respawn(i: int) -> None:  # worker i again, on a new port
        config.processes[i], config.workers[i] = spawn(i)

    started = [spawn(i, port) for i, port in enumerate(free_ports(n, avoid))]
    config = ClusterConfig(token, [spec for _, spec in started], [process for process, _ in started], respawn)
    return config


async def wait_healthy(config: ClusterConfig, timeout_s: float, tries: int = 3) -> list[dict]:
    """Wait until every worker answers /health, each a process of its own; a local worker that exits (or whose
    port turns out to be someone else's) is started again on a new port, up to `tries` times."""
    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {config.token}"}
    async with httpx.AsyncClient(headers=headers, timeout=5) as client:
        answers: list[dict] = []
        for i in range(len(config.workers)):
            attempt = 1
            while True:
                local = config.processes[i] if i < len(config.processes) else None
                answer, problem = await _health(client, config.workers[i].url, local, answers)
                if answer is not None:
                    answers.append(answer)
                    break
                if problem:
                    if config.respawn is None or attempt >= tries:
                        raise RuntimeError(f"worker {config.workers[i].url} {problem}")
                    attempt += 1
                    if local is not None and local.poll() is None:
                        local.terminate()
                    config.respawn(i)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {config.workers[i].url} did not answer within {timeout_s:.0f} s")
                await asyncio.sleep(0.3)
    return answers


async def _health(client: httpx.AsyncClient, url: str, local: subprocess.Popen | None,
                  earlier: list[dict]) -> tuple[dict | None, str | None]:
    # (the worker's /health answer, None) once it answers as itself; (None, a problem) when it never will;
    # (None, None) while it is starting
    try:
        r = await client.get(url + "/health")
        if r.status_code != 200:
            return None, f"answered {r.status_code}: {r.text[:200]}"
        answer = r.json()
        if local is not None:  # the process we started, not one that had the port first
            pid = (await client.get(url + "/info")).json().get("pid")
            if pid != local.pid:
                return None, f"is answered by another process (pid {pid}, not {local.pid})"
        if any(a.get("instance") == answer.get("instance") for a in earlier):
            return None, "is the same process as an earlier worker"  # two URLs, one worker
        return answer, None
    except httpx.HTTPError:
        if local is not None and local.poll() is not None:
            return None, f"exited with {local.returncode} during start-up"
        return None, None


async def cluster_health(urls: list[str], token: str) -> list[dict]:
    """Each worker's /health answer, or its error, within a short timeout."""
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(headers=headers, timeout=2) as client:

        async def one(url: str) -> dict:
            try:
                r = await client.get(url + "/health")
                if r.status_code == 200:
                    return {"url": url, **r.json()}
                return {"url": url, "status": "error", "error": f"HTTP {r.status_code}"}
            except httpx.HTTPError as exc:
                return {"url": url, "status": "down", "error": type(exc).__name__}

        return list(await asyncio.gather(*(one(u) for u in urls)))

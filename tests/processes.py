"""Real processes for the distributed tests: `edgespec worker` and `edgespec serve`, on loopback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (each socket is held until all are found)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Proc:
    """A child process of `python -m edgespec.server.cli ...` (or of `command ...`: the Home Assistant tests, in a
    venv without edgespec, run the main venv's `edgespec`) with its log; stopped by stop()."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, command: list[str] | None = None):
        self.args, self.log = args, log
        command = [sys.executable, "-m", "edgespec.server.cli"] if command is None else command
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([*command, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=None if env is None else {**os.environ, **env})

    def wait_healthy(self, url: str, headers: dict | None = None, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url + "/health", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not healthy in {timeout_s} s:\n{self.tail()}")
            time.sleep(0.25)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(15)

    def started(self, url: str, headers: dict | None = None) -> None:
        """wait_healthy, and on failure stop the process: a test that never got it cannot stop it."""
        try:
            self.wait_healthy(url, headers)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def start_worker(tmp: Path, token: str, model: str | None, name: str, port: int | None = None,
                 *extra: str) -> tuple[Proc, str]:
    proc, url = _spawn_worker(tmp, token, model, name, port or free_port(), extra)
    proc.started(url, {"authorization": f"Bearer {token}"})
    return proc, url


def start_workers(tmp: Path, token: str, model: str | None, extra: dict[str, tuple[str, ...]]
                  ) -> dict[str, tuple[Proc, str]]:
    """start_worker for each name with its extra arguments, all spawned before any is waited for (their starts,
    seconds of importing torch each, overlap)."""
    ports = free_ports(len(extra))
    spawned = {name: _spawn_worker(tmp, token, model, name, port, args)
               for (name, args), port in zip(extra.items(), ports, strict=True)}
    try:
        for proc, url in spawned.values():
            proc.wait_healthy(url, {"authorization": f"Bearer {token}"})
    except BaseException:
        for proc, _ in spawned.values():
            proc.stop()
        raise
    return spawned


def _spawn_worker(tmp: Path, token: str, model: str | None, name: str, port: int,
                  extra: tuple[str, ...]) -> tuple[Proc, str]:
    args = ["worker", "--port", str(port), "--token", token, "--name", name, "--threads", "1", *extra]
    return Proc(args + (["--model", model] if model else []), tmp / f"{name}.log"), f"http://127.0.0.1:{port}"


def start_server(tmp: Path, name: str, *extra: str, env: dict | None = None) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(["serve", "--port", str(port), "--log-level", "warning", *extra],
                tmp / f"{name}.log", env)
    url = f"http://127.0.0.1:{port}"
    proc.started(url)
    return proc, url


class Servers:
    """`edgespec serve` processes by their arguments, each started at its first request and stopped by close():
    tests that serve one configuration share one server (a start with workers is 10-30 s of processes importing
    torch, loading the model and profiling the cluster). A test that reads a counter of a shared server reads how
    much it moved, not its value."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.started: dict[tuple[str, ...], tuple[Proc, str]] = {}

    def url(self, *args: str) -> str:
        if args not in self.started:
            self.started[args] = start_server(self.tmp, f"shared{len(self.started)}", *args)
        return self.started[args][1]

    def close(self) -> None:
        for proc, _ in self.started.values():
            proc.stop()


def local_workers(model: str, n: int, *extra: str) -> tuple[str, ...]:
    """serve's arguments for `model` over n local workers of one thread each, layers placed evenly (every worker
    on the path); one spelling, so that the tests that serve it share the server (Servers)."""
    return ("--model", model, "--local-workers", str(n), "--placement", "even", "--worker-threads", "1", *extra)


def tiny_chat_model(folder: Path, smollm2: Path, max_position_embeddings: int = 512) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (so the HTTP API can serve it)."""
    from model_fixtures import make_tiny_model

    make_tiny_model(folder, vocab_size=49152, max_position_embeddings=max_position_embeddings, num_hidden_layers=4,
                    bos_token_id=1, eos_token_id=2)
    for f in smollm2.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


def greedy(url: str, prompt: str, max_tokens: int, headers: dict | None = None) -> str:
    body = {"model": model_id(url), "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def model_id(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def stream_text(url: str, decoding, on_chunk=None, max_tokens: int = 40, min_tokens: int = 0,
                content: str = "Give me three tips for a good night's sleep.") -> tuple[str, list[dict]]:
    """A greedy streamed chat completion of the served model: its text and every payload; on_chunk(i) after the
    i-th content chunk (a fault comes mid-stream: the lines are read as they arrive)."""
    body = {"model": model_id(url), "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "decoding": decoding, "stream": True}
    if min_tokens:
        body["min_tokens"] = min_tokens
    text, payloads, n = [], [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        last = None
        for line in r.iter_lines():
            last = line or last
            if not line.startswith("data: {"):
                continue
            payloads.append(json.loads(line[6:]))
            for choice in payloads[-1].get("choices", []):
                if choice["delta"].get("content"):
                    text.append(choice["delta"]["content"])
                    n += 1
                    if on_chunk:
                        on_chunk(n)
        assert last == "data: [DONE]"
    return "".join(text), payloads


def workers(url: str) -> list[dict]:
    """The controller's workers, as /health lists them."""
    return httpx.get(url + "/health", timeout=30).json().get("workers", [])


def worker_pid(server_pid: int, worker_url: str) -> int:
    """The local worker process (a child of the controller) that listens where worker_url says."""
    port = worker_url.rsplit(":", 1)[1]
    ps = ["ps", "-ww", "--ppid", str(server_pid), "-o", "pid=,args="]
    out = subprocess.run(ps, capture_output=True, text=True).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if f"--port {port} " in line + " "]
    assert len(pids) == 1, out
    return pids[0]


def wait_all_back(url: str, n: int, timeout_s: float = 120) -> None:
    """Until the controller has n workers, every one ok (a killed local worker started again and planned in)."""
    deadline = time.monotonic() + timeout_s
    while not (len(w := workers(url)) == n and all(x.get("status") == "ok" for x in w)):
        assert time.monotonic() < deadline, f"workers not all back: {w}"
        time.sleep(0.3)

"""Real processes for the distributed tests: `edgespec worker` and `edgespec serve`, on loopback."""

from __future__ import annotations

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process of `python -m edgespec.server.cli ...` with its log; stopped by stop()."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.args, self.log = args, log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "edgespec.server.cli", *args], cwd=REPO, stdout=f,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=None if env is None else {**os.environ, **env})

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
    port = port or free_port()
    args = ["worker", "--port", str(port), "--token", token, "--name", name, "--threads", "1", *extra]
    proc = Proc(args + (["--model", model] if model else []), tmp / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    proc.started(url, {"authorization": f"Bearer {token}"})
    return proc, url


def start_server(tmp: Path, name: str, *extra: str, env: dict | None = None) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(["serve", "--port", str(port), "--log-level", "warning", *extra],
                tmp / f"{name}.log", env)
    url = f"http://127.0.0.1:{port}"
    proc.started(url)
    return proc, url


def tiny_chat_model(folder: Path, smollm2: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (so the HTTP API can serve it)."""
    from model_fixtures import make_tiny_model

    make_tiny_model(folder, vocab_size=49152, max_position_embeddings=512, num_hidden_layers=4,
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

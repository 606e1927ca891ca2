"""A real `edgespec serve` for the Home Assistant tests and the request recorder, run from the HA venv.

edgespec cannot be imported here (its lock is for Python 3.11, Home Assistant's venv is 3.13), so the server is
the main venv's `.venv/bin/edgespec`, started as a child process on a free loopback port, as tests/processes.py
starts it for the main suite.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
# the main venv's command; EDGESPEC names another (a venv elsewhere, an installed `edgespec`)
EDGESPEC = os.environ.get("EDGESPEC", str(REPO / ".venv" / "bin" / "edgespec"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Edgespec:
    """A running server: its base URL (no /v1), the id of the model it serves and its log file."""

    url: str
    model: str
    log: Path
    proc: subprocess.Popen

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def start(log: Path, *args: str, timeout_s: float = 300) -> Edgespec:
    """`edgespec serve` on the default model and a free port, once /health answers 200; its output in `log`.
    Stopped again (and the log's tail raised) when it exits or is not healthy within timeout_s."""
    port = free_port()
    with open(log, "ab") as f:
        proc = subprocess.Popen([EDGESPEC, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                                 "warning", *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    server = Edgespec(url, "", log, proc)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"edgespec serve exited with {proc.returncode}:\n{server.tail()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"edgespec serve not healthy in {timeout_s} s:\n{server.tail()}")
            time.sleep(0.25)
        server.model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    except BaseException:
        server.stop()
        raise
    return server

"""A real `edgespec serve` for the Home Assistant tests and the request recorder, run from the HA venv.

edgespec cannot be imported here (its lock is for Python 3.11, Home Assistant's venv is 3.13), so the server is
the main venv's `.venv/bin/edgespec`, started by tests/processes.py's Proc (stdlib and httpx only; pytest.ini puts
tests/ on the path) as the main suite starts its servers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx
from processes import REPO, Proc, free_port

# the main venv's command; EDGESPEC names another (a venv elsewhere, an installed `edgespec`)
EDGESPEC = os.environ.get("EDGESPEC", str(REPO / ".venv" / "bin" / "edgespec"))


@dataclass
class Edgespec:
    """A running server: its base URL (no /v1), the id of the model it serves, and its process."""

    url: str
    model: str
    proc: Proc

    def stop(self) -> None:
        self.proc.stop()


def start(log: Path, *args: str, timeout_s: float = 300) -> Edgespec:
    """`edgespec serve` on the default model and a free port, once /health answers 200; its output in `log`.
    Stopped again (and the log's tail raised) when it exits or is not healthy within timeout_s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args], log,
                command=[EDGESPEC])
    try:
        proc.wait_healthy(url, timeout_s=timeout_s)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    except BaseException:
        proc.stop()
        raise
    return Edgespec(url, model, proc)

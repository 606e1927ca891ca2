"""llama.cpp's OpenAI-compatible server (llama-cpp-python) as a benchmark peer, and server processes in general.

llama-cpp-python lives in its own virtual environment (`make peer-env`), so that its pins never touch
edgespec's: its interpreter is --llama-python, else $EDGESPEC_LLAMA_PYTHON, else /root/llamacpp-venv/bin/python.
`ServerProcess` starts any server as a child process in its own session, waits until a readiness URL
answers 200, reads the peak resident memory of the process and its descendants, and stops it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

DEFAULT_LLAMA_PYTHON = "/root/llamacpp-venv/bin/python"
LLAMA_PYTHON_ENV = "EDGESPEC_LLAMA_PYTHON"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Every descendant of `pid` (children, their children, ...), from the parent ids in /proc/*/stat."""
    parents: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def vm_hwm_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The peak resident set size of one process (VmHWM in /proc/PID/status), or None if unreadable."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def peak_rss_bytes(pid: int) -> int | None:
    """Sum of the peak RSS of a process and all its descendants (an upper bound: pages shared between them
    count once per process, and the peaks need not coincide)."""
    values = [vm_hwm_bytes(p) for p in [pid, *child_pids(pid)]]
    values = [v for v in values if v is not None]
    return sum(values) if values else None


class ServerProcess:
    """A server as a child process with its log file; `wait_ready` polls `ready_path` until it answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, ready_path: str,
                 cwd: Path | None = None, env: dict | None = None):
        self.name, self.argv, self.log, self.ready_path = name, argv, log, ready_path
        self.url = f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as f:
            # its own session, so that stop() can end workers it started too
            self.proc = subprocess.Popen(argv, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=None if env is None else {**os.environ, **env})

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log {self.log}:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready in {timeout_s:.0f} s; log {self.log}:\n{self.tail()}")
            time.sleep(0.5)

    def peak_rss_bytes(self) -> int | None:
        return peak_rss_bytes(self.proc.pid)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # anything it left in its session
            os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def llama_python(explicit: str | None = None) -> str:
    """The interpreter of llama-cpp-python's virtual environment."""
    python = explicit or os.environ.get(LLAMA_PYTHON_ENV) or DEFAULT_LLAMA_PYTHON
    if not Path(python).exists():
        raise FileNotFoundError(f"no llama-cpp-python interpreter at {python}: run `make peer-env`, or name one "
                                f"with --llama-python or ${LLAMA_PYTHON_ENV}")
    return python


def llamacpp_version(python: str) -> str | None:
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('llama_cpp_python'))"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return None
    return probe.stdout.strip() or None


def llamacpp_argv(python: str, gguf: Path, port: int, n_threads: int = 2, n_ctx: int = 2048) -> list[str]:
    return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(n_threads), "--n_ctx", str(n_ctx)]


def start_llamacpp(gguf: Path, log: Path, python: str | None = None, n_threads: int = 2, n_ctx: int = 2048,
                   port: int | None = None, timeout_s: float = 600) -> ServerProcess:
    """llama.cpp's server on `gguf`, once GET /v1/models answers; stop it with .stop() (or use `with`)."""
    port = port or free_port()
    server = ServerProcess("llama.cpp", llamacpp_argv(llama_python(python), gguf, port, n_threads, n_ctx), port,
                           log, "/v1/models")
    try:
        server.wait_ready(timeout_s)
    except BaseException:
        server.stop()
        raise
    return server

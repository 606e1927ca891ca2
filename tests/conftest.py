"""Shared fixtures: one real `edgespec serve` process for the end-to-end tests, and an OpenAI client for it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
STARTUP_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, chars: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    """Base URL (no trailing slash) of a real server: SmolLM2 in its default format (the GGUF's Q4_1 layers and
    Q8_0 head, what `edgespec serve` serves), API key `test-key`."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    cmd = [sys.executable, "-m", "edgespec.server.cli", "serve", "--port", str(port), "--api-key", API_KEY]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`{' '.join(cmd)}` exited with {proc.returncode} before it was healthy; its log:\n"
                            f"{_log_tail(log_path)}", pytrace=False)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not healthy within {STARTUP_TIMEOUT_S} s; its log:\n"
                            f"{_log_tail(log_path)}", pytrace=False)
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="session")
def client(server_url) -> openai.OpenAI:
    # No retries: a failure should show as it happened, not after the SDK's back-off.
    return openai.OpenAI(base_url=server_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    """Folder of a tiny random Llama with SmolLM2's tokenizer and chat template (servable over HTTP)."""
    from model_fixtures import smollm2_folder
    from processes import tiny_chat_model

    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm2_folder()))


@pytest.fixture(scope="session")
def tiny_loaded(tiny):
    """That model in-process (float32). Tests that replace its executor's pipeline or cuts put them back."""
    from edgespec.model.load import load_local
    from edgespec.model.source import resolve_model
    from edgespec.model.thread import ModelThread

    model = load_local(resolve_model(tiny), "float32", 1.0, ModelThread(1))
    yield model
    model.executor.close()


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    """Servers shared by the tests that serve the same configuration (processes.Servers), stopped at the end."""
    from processes import Servers

    pool = Servers(tmp_path_factory.mktemp("servers"))
    yield pool
    pool.close()

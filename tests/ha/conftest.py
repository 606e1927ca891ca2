"""Fixtures of the Home Assistant tests: one real edgespec server for the session, and a home in HA's `hass`.

Run in the HA venv: `.venv-ha/bin/python -m pytest -q tests/ha` (Makefile: `make install-ha`, part of `make
test`). pytest-homeassistant-custom-component blocks sockets in every test; `socket_enabled` lets HA's
integrations reach the server on 127.0.0.1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import pytest_socket
from edgespec_proc import Edgespec, start

# Home Assistant's Ollama integration sets no sampling option (only num_ctx): the server's defaults make its answers
# greedy, as the OpenAI integration's are with temperature 0, and as long at most as that one's (its max_tokens)
OLLAMA = {"temperature": 0, "num_predict": 150}


@pytest.fixture(scope="session")
def edgespec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edgespec]:
    """`edgespec serve` on the default model, for the whole session (its Ollama API's defaults: OLLAMA)."""
    # Built during the first test's set-up, after the HA plugin blocked sockets (pytest_runtest_setup); the
    # function-scoped `socket_enabled` cannot serve a session fixture, so the start unblocks them itself and
    # leaves them as the plugin set them.
    pytest_socket.enable_socket()
    try:
        server = start(tmp_path_factory.mktemp("edgespec") / "serve.log", "--ollama-options", json.dumps(OLLAMA))
    finally:
        pytest_socket.socket_allow_hosts(["127.0.0.1"])
        pytest_socket.disable_socket(allow_unix_socket=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fixed_clock(freezer) -> None:
    """The wall clock at one moment: Home Assistant renders the time, to the second, at the top of its system
    prompt, so a greedy answer would otherwise depend on when the test runs."""
    freezer.move_to("2025-06-02 08:00:00")

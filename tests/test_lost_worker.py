"""A worker lost mid-stream costs the stream nothing (SmolLM2 in its served format over 2 local worker
processes): SIGKILL or SIGSTOP of a worker of the placement while a stream runs, and the stream completes
with the same text as without the fault, for naive, speculative, medusa and headsplit (epsilon 0); the
controller starts a killed local worker again and plans it back in, and a stopped one rejoins once it
answers again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest
from processes import start_server

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Give me three tips for a good night's sleep."}]


def stream(url: str, decoding, on_chunk=None, max_tokens: int = 40) -> tuple[str, list[dict]]:
    """The streamed text and every payload; on_chunk(i) after the i-th content chunk."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens,
            "decoding": decoding, "stream": True}
    text, payloads, n = [], [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        last = None
        for line in r.iter_lines():  # as they arrive: the fault comes mid-stream
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
    deadline = time.monotonic() + timeout_s
    while not (len(w := workers(url)) == n and all(x.get("status") == "ok" for x in w)):
        assert time.monotonic() < deadline, f"workers not all back: {w}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("lost"), "lost", "--local-workers", "2", "--placement", "even",
                             "--worker-threads", "1", "--stage-timeout-s", "4", "--recover-probe-s", "2",
                             "--monitor-interval-s", "0.5")
    try:
        yield proc, url
    finally:
        proc.stop()


@pytest.mark.parametrize("decoding", ["naive", "speculative", "medusa", {"policy": "headsplit", "epsilon": 0}],
                         ids=["naive", "speculative", "medusa", "headsplit"])
def test_sigkill_mid_stream_gives_the_same_text(served, decoding):
    proc, url = served
    wait_all_back(url, 2)
    want, _ = stream(url, decoding)
    victim = worker_pid(proc.proc.pid, workers(url)[-1]["url"])
    got, payloads = stream(url, decoding, lambda i: i == 5 and os.kill(victim, signal.SIGKILL))
    assert not any("error" in p for p in payloads)
    assert got == want
    wait_all_back(url, 2)  # started again and planned back in
    assert stream(url, decoding)[0] == want


def test_a_hung_worker_is_planned_out_and_rejoins(served):
    proc, url = served
    wait_all_back(url, 2)
    want, _ = stream(url, "naive")
    victim = worker_pid(proc.proc.pid, workers(url)[0]["url"])
    try:
        got, payloads = stream(url, "naive", lambda i: i == 5 and os.kill(victim, signal.SIGSTOP))
        assert not any("error" in p for p in payloads)
        assert got == want
        assert len(workers(url)) == 1  # served by the other worker alone meanwhile
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["status"] == "degraded" and len(health["lost"]) == 1
    finally:
        os.kill(victim, signal.SIGCONT)
    wait_all_back(url, 2)
    assert stream(url, "naive")[0] == want


def test_with_every_worker_hung_the_controller_serves_alone_until_they_answer(served):
    proc, url = served
    wait_all_back(url, 2)
    want, _ = stream(url, "speculative")
    victims = [worker_pid(proc.proc.pid, w["url"]) for w in workers(url)]

    def hang(i: int) -> None:
        if i == 5:
            for pid in victims:
                os.kill(pid, signal.SIGSTOP)

    try:
        got, payloads = stream(url, "speculative", hang)
        assert not any("error" in p for p in payloads)
        assert got == want
        assert workers(url) == []  # every layer on the controller meanwhile
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'outcome="controller"' in metrics
    finally:
        for pid in victims:
            os.kill(pid, signal.SIGCONT)
    wait_all_back(url, 2)
    assert stream(url, "speculative")[0] == want

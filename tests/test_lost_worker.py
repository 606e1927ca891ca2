"""A worker lost mid-stream costs the stream nothing (SmolLM2 in its served format over 2 local worker
processes): SIGKILL or SIGSTOP of a worker of the placement while a stream runs, and the stream completes
with the same text as without the fault, for naive, speculative, medusa and headsplit (epsilon 0); the
controller starts a killed local worker again and plans it back in, and a stopped one rejoins once it
answers again."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from processes import start_server, stream_text, wait_all_back, worker_pid, workers

pytestmark = pytest.mark.slow

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
    want, _ = stream_text(url, decoding)
    victim = worker_pid(proc.proc.pid, workers(url)[-1]["url"])
    got, payloads = stream_text(url, decoding, lambda i: i == 5 and os.kill(victim, signal.SIGKILL))
    assert not any("error" in p for p in payloads)
    assert got == want
    wait_all_back(url, 2)  # started again and planned back in
    assert stream_text(url, decoding)[0] == want


def test_a_hung_worker_is_planned_out_and_rejoins(served):
    proc, url = served
    wait_all_back(url, 2)
    want, _ = stream_text(url, "naive")
    victim = worker_pid(proc.proc.pid, workers(url)[0]["url"])
    try:
        got, payloads = stream_text(url, "naive", lambda i: i == 5 and os.kill(victim, signal.SIGSTOP))
        assert not any("error" in p for p in payloads)
        assert got == want
        assert len(workers(url)) == 1  # served by the other worker alone meanwhile
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["status"] == "degraded" and len(health["lost"]) == 1
    finally:
        os.kill(victim, signal.SIGCONT)
    wait_all_back(url, 2)
    assert stream_text(url, "naive")[0] == want


def test_with_every_worker_hung_the_controller_serves_alone_until_they_answer(served):
    proc, url = served
    wait_all_back(url, 2)
    want, _ = stream_text(url, "speculative")
    victims = [worker_pid(proc.proc.pid, w["url"]) for w in workers(url)]

    def hang(i: int) -> None:
        if i == 5:
            for pid in victims:
                os.kill(pid, signal.SIGSTOP)

    try:
        got, payloads = stream_text(url, "speculative", hang)
        assert not any("error" in p for p in payloads)
        assert got == want
        assert workers(url) == []  # every layer on the controller meanwhile
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'outcome="controller"' in metrics
    finally:
        for pid in victims:
            os.kill(pid, signal.SIGCONT)
    wait_all_back(url, 2)
    assert stream_text(url, "speculative")[0] == want

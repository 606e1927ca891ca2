"""Distributed serving over real worker processes: equivalence, the cluster token, input validation, and
a worker that dies mid-generation. Tiny random model (SmolLM2's tokenizer) except where marked slow."""

from __future__ import annotations

import json
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import websockets
from links import TestLink
from processes import REPO, greedy, local_workers, model_id, start_server, start_worker, start_workers

from edgespec.model.kv_pool import CapacityError
from edgespec.model.stage import StageFailure
from edgespec.workers.host import StageHost, StepError
from edgespec.workers.settings import WorkerSettings
from edgespec.workers.uplink import refusal
from edgespec.workers.wire import BatchMessage, decode, decode_batch, encode, encode_batch

PROMPTS = ["Name three rivers.", "Write a haiku about the sea, please, with care."]


@pytest.fixture(scope="module")
def reference(tiny, servers):
    """Greedy outputs of the in-process server (cold: test_workers_prefill.py's reference server)."""
    url = servers.url("--model", tiny, "--prefix-cache-mib", "0")
    return {p: greedy(url, p, 24) for p in PROMPTS}


# One worker is the first and the last stage at once; three have a first, a middle and a last (a fourth would be
# another middle, the same relay). The two- and three-worker servers are test_workers_prefill.py's (its prefill
# cuts at every token over three): one start each for both files. Decoding is one token a step whatever the cuts.
@pytest.mark.parametrize("n", [1, 2, 3])
def test_local_workers_match_in_process(n, tiny, reference, servers, tmp_path):
    proc = None
    if n == 1:
        proc, url = start_server(tmp_path, f"serve{n}", *local_workers(tiny, n))
    else:
        url = servers.url(*local_workers(tiny, n, *(("--prefill-segment", "1") if n == 3 else ())))
    try:
        for prompt, expected in reference.items():
            assert greedy(url, prompt, 24) == expected
        stats = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": model_id(url), "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "max_tokens": 8, "min_tokens": 8}).json()["decoding"]
        links = stats["wire_links"]
        assert len(links) == n + 1  # controller -> w0 -> ... -> controller
        hidden_bytes = 64 * 4  # tiny model: hidden 64, float32
        for link in links.values():
            assert link["requests_per_token"] > 0
            if link["decode_bytes_per_token"] is not None:
                # one hidden state per decoding step plus the safetensors header
                assert hidden_bytes <= link["decode_bytes_per_token"] <= hidden_bytes + 200
        metrics = httpx.get(url + "/metrics").text
        assert 'edgespec_wire_bytes_total{link="controller->worker0"}' in metrics
        assert "edgespec_stage_forward_seconds" in metrics
        if n == 2:
            concurrent_streams_share_one_message_per_link(url, reference)
    finally:
        if proc is not None:
            proc.stop()


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def concurrent_streams_share_one_message_per_link(url: str, reference: dict) -> None:
    """Concurrent streams over workers give their texts alone, and a shared step is one message per link:
    the link's messages fall short of the sessions' own counts by exactly the calls that rode along."""
    link = 'edgespec_wire_requests_total{link="controller->worker0"}'
    names = ("edgespec_shared_passes", "edgespec_shared_pass_calls", link)
    before = httpx.get(url + "/metrics").text

    def run(prompt: str) -> tuple[str, int]:
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "model": model_id(url), "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": 24})
        body = r.json()
        tokens = body["usage"]["completion_tokens"]
        own = body["decoding"]["wire_links"]["controller->worker0"]["requests_per_token"] * tokens
        return body["choices"][0]["message"]["content"], round(own)

    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[1]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, prompts))
    assert [text for text, _ in results] == [reference[p] for p in prompts]
    after = httpx.get(url + "/metrics").text
    passes, calls, messages = (metric(after, m) - metric(before, m) for m in names)
    assert passes > 0, "concurrent streams never shared a step"
    assert sum(own for _, own in results) - messages == calls - passes  # one message per shared step


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    token = secrets.token_hex(8)
    proc, url = start_worker(tmp_path_factory.mktemp("w"), token, tiny, "solo")
    auth = {"authorization": f"Bearer {token}"}
    r = httpx.post(url + "/assign", json={"first": 0, "last": 2, "dtype": "float32"}, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    try:
        yield url, auth
    finally:
        proc.stop()


def test_worker_refuses_wrong_or_missing_token(worker):
    url, auth = worker
    calls = [("GET", "/info", None), ("POST", "/assign", {"first": 0, "last": 1})]
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": auth["authorization"] + "x"}):
        wrong_token = [("GET", "/health", None)] if headers else []  # /health without one is a liveness probe
        for method, path, body in calls + wrong_token:
            r = httpx.request(method, url + path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert "token" in r.json()["error"]["message"]
    for token in ("wrong", token_of(auth) + "x"):  # a stranger's link is refused at its handshake
        with pytest.raises(websockets.InvalidStatus) as refused:
            TestLink(url, token)
        assert refused.value.response.status_code == 403
    # without a token, /health says only that the worker is up
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/health", headers=auth).json()["name"] == "solo"
    info = httpx.get(url + "/info", headers=auth).json()
    assert info["holds"]["layers"] == [0, 2]  # the refused /assign changed nothing
    assert info["sessions"] == 0


def token_of(auth: dict) -> str:
    return auth["authorization"].removeprefix("Bearer ")


def sessions(url: str, auth: dict, expected: int) -> bool:
    """Whether the worker comes to hold `expected` sessions (a release is not acknowledged)."""
    for _ in range(50):
        if httpx.get(url + "/info", headers=auth).json()["sessions"] == expected:
            return True
        time.sleep(0.1)
    return False


def test_worker_validates_inputs_and_keeps_other_sessions(worker):
    url, auth = worker
    link = TestLink(url, token_of(auth))
    assert link.op("open", session="good", step=1, capacity=16)["ok"]
    hidden = torch.randn(1, 3, 64)
    cases = [
        ("garbage body", "good", {"start": 0}, b"not safetensors", 400),
        ("wrong hidden size", "good", {"start": 0}, encode({"hidden": torch.randn(1, 3, 65)}), 400),
        ("integer hidden", "good", {"start": 0}, encode({"hidden": torch.ones(1, 3, 64, dtype=torch.int64)}), 400),
        ("extra tensor", "good", {"start": 0}, encode({"hidden": hidden, "x": torch.zeros(1)}), 400),
        ("bad positions", "good", {"start": 0}, encode({"hidden": hidden, "positions": torch.tensor([[0, 1, 9999]])}),
         400),
        ("gap in the cache", "good", {"start": 5}, encode({"hidden": hidden}), 400),
        ("past capacity", "good", {"start": 0}, encode({"hidden": torch.randn(1, 17, 64)}), 400),
        ("unknown session", "nope", {"start": 0}, encode({"hidden": hidden}), 404),
        ("missing start", "good", {}, encode({"hidden": hidden}), 400),
        ("a route that is no URL", "good", {"start": 0, "route": ["ftp://x"]}, encode({"hidden": hidden}), 400),
    ]
    for label, sid, fields, body, status in cases:
        link.send({"op": "forward", "session": sid, "step": 2, **fields}, body)
        header, _ = link.answer(sid, 2)
        assert header["op"] == "error" and header["status"] == status, (label, header)
        assert header["message"], label
    wrong_layers = link.op("open", session="y", step=1, capacity=8, layers=[2, 4])
    assert wrong_layers["status"] == 409 and "[0, 2)" in wrong_layers["message"]
    assert link.op("open", session="x", step=1, capacity=-3)["status"] == 400
    assert link.op("open", session="x" * 129, step=1, capacity=3)["status"] == 400
    link.conn.send(b"\x05\x00")  # not a frame
    assert link.wait(lambda h: h["op"] == "error")[0]["code"] == "invalid_frame"
    # a stale step is refused
    assert link.op("commit", session="good", step=0, kept=[0], dest=0)["code"] == "stale_step"
    # a message over the worker's bound closes that link and nothing else: the sender sees the close (1009), or,
    # when the worker closed while the 65 MiB were still being written, the connection reset
    with pytest.raises(websockets.ConnectionClosed) as closed:
        link.send({"op": "forward", "session": "good", "step": 2, "start": 0}, b"0" * (65 * 2**20))
        link.answer("good", 2)
    assert closed.value.rcvd is None or closed.value.rcvd.code == 1009
    assert httpx.get(url + "/info", headers=auth).json()["sessions"] == 1  # the session itself is untouched
    other = TestLink(url, token_of(auth))
    other.send({"op": "release", "session": "good"})
    assert sessions(url, auth, 0)
    other.close()


def _stream(url: str, prompt: str, max_tokens: int):
    body = {"model": model_id(url), "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    return httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120)


def test_killed_worker_costs_the_stream_nothing_and_rejoins(tiny, reference, tmp_path):
    token = secrets.token_hex(8)
    (w0, url0), (w1, url1) = start_workers(tmp_path, token, tiny, {"w0": (), "w1": ()}).values()
    port1 = int(url1.rsplit(":", 1)[1])
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(f'token = "{token}"\n[[workers]]\nurl = "{url0}"\nname = "w0"\n'
                       f'[[workers]]\nurl = "{url1}"\nname = "w1"\n')
    server = None
    try:
        server, url = start_server(tmp_path, "serve", "--model", tiny, "--cluster", str(cluster), "--placement",
                                   "even", "--monitor-interval-s", "0.5")
        lines = []
        with _stream(url, PROMPTS[0], 24) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 6:
                    w1.kill()  # dies mid-stream
        payloads = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]"
        assert not any("error" in p for p in payloads), payloads[-1]
        # re-planned onto w0, every layer, and the stream went on with the tokens it would have had
        text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p.get("choices"))
        assert text == reference[PROMPTS[0]]
        # w1 is out of the placement; new requests are served by w0 alone
        deadline = time.monotonic() + 60
        while "w1" in {w["name"] for w in httpx.get(url + "/health", timeout=30).json()["workers"]}:
            assert time.monotonic() < deadline, "no re-plan without the dead worker"
            time.sleep(0.2)
        assert greedy(url, PROMPTS[0], 24) == reference[PROMPTS[0]]
        w1, _ = start_worker(tmp_path, token, tiny, "w1", port=port1)  # back, empty: planned in again
        while {w["name"] for w in httpx.get(url + "/health", timeout=30).json()["workers"]} != {"w0", "w1"}:
            assert time.monotonic() < deadline, "w1 was not planned in again"
            time.sleep(0.2)
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        assert greedy(url, PROMPTS[0], 24) == reference[PROMPTS[0]]
    finally:
        if server is not None:
            server.stop()
        w0.stop()
        w1.stop()


SMOL_PROMPT = "What is the capital of France? Answer in one sentence."


def tool_calls(url: str) -> list[tuple[str, str]]:
    """Home Assistant's request with its tools, tool_choice required: the calls (the route's and the trigger's
    passes, and the grammar, go through the stages like any other)."""
    ha = json.loads((REPO / "bench/prompts/home_assistant.json").read_text())
    body = {"model": model_id(url), "temperature": 0, "max_tokens": 64, "tools": ha["tools"], "tool_choice": "auto",
            "messages": [{"role": "system", "content": ha["system"]},
                         {"role": "user", "content": ha["commands"][1]["prompt"]}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    message = r.json()["choices"][0]["message"]
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


@pytest.fixture(scope="module")
def smollm2_reference(servers):
    """In-process, cold (test_workers_prefill.py's reference server of SmolLM2)."""
    url = servers.url("--prefix-cache-mib", "0")
    return greedy(url, SMOL_PROMPT, 32), tool_calls(url)


# The planner's placement over four workers puts layers on each (a first, two middles in its own order, a last):
# everything two would show; one holds every layer, first and last at once.
@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 4])
def test_smollm2_over_workers_matches_in_process(n, smollm2_reference, tmp_path):
    text, calls = smollm2_reference
    assert calls  # the command is a call in-process: over workers it must be the same call
    dist, url = start_server(tmp_path, f"dist{n}", "--local-workers", str(n))
    try:
        assert greedy(url, SMOL_PROMPT, 32) == text
        assert tool_calls(url) == calls
    finally:
        dist.stop()


def test_local_worker_respawns_when_its_port_was_taken(tiny, monkeypatch):
    import asyncio
    import socket

    from edgespec.workers import cluster

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real = cluster.free_ports
        monkeypatch.setattr(cluster, "free_ports", lambda n, avoid=None: [next(ports, None) or real(1, avoid)[0]])
        config = cluster.launch_local_workers(1, tiny, threads=1)
        try:
            assert config.workers[0].url.endswith(f":{busy}")
            answers = asyncio.run(cluster.wait_healthy(config, timeout_s=120))
            assert answers[0]["status"] == "ok"
            assert not config.workers[0].url.endswith(f":{busy}")  # started again on a free port
        finally:
            config.stop()


def test_two_local_workers_given_one_port_end_as_two_processes(tiny, monkeypatch):
    """The flaky 409 ("this worker holds layers [2, 4), not [0, 2]"): two workers once got the same port, both
    URLs reached the one that bound it, and assigning "worker1" moved worker0's layers. Ports are now found
    together (distinct), and a URL answered by a process other than the one started there is respawned."""
    import asyncio

    from edgespec.workers import cluster

    assert len(set(cluster.free_ports(8))) == 8
    real = cluster.free_ports
    first = iter([real(1)[0]] * 2)
    monkeypatch.setattr(cluster, "free_ports",
                        lambda n, avoid=None: [next(first) for _ in range(n)] if n == 2 else real(n, avoid))
    config = cluster.launch_local_workers(2, tiny, threads=1)
    try:
        assert config.workers[0].url == config.workers[1].url  # the old race, forced
        answers = asyncio.run(cluster.wait_healthy(config, timeout_s=120))
        assert config.workers[0].url != config.workers[1].url
        assert answers[0]["instance"] != answers[1]["instance"]
        for spec, proc in zip(config.workers, config.processes, strict=True):
            info = httpx.get(spec.url + "/info", headers={"authorization": f"Bearer {config.token}"}).json()
            assert info["pid"] == proc.pid and info["name"] == spec.name
    finally:
        config.stop()


def test_a_forked_session_reads_its_parents_prefix_and_is_applied_once(tiny):
    """Outline's points on a worker: a fork reads the parent's first slots in place and its rows get the bits
    of a session that holds the whole prefix itself; a retried fork is not applied twice."""
    host = StageHost(WorkerSettings(port=0, token="t", model=tiny))
    host.assign(None, 0, 2, "float32")
    torch.manual_seed(0)
    prompt, row = torch.randn(1, 5, 64), torch.randn(1, 1, 64)
    for sid in ("parent", "whole"):
        host.open(sid, 1, 16)
        host.forward(sid, 2, 0, encode({"hidden": prompt}))
    host.fork("parent", 3, "point", 5, 8)
    host.fork("parent", 3, "point", 5, 8)  # a retry
    got = decode(host.forward("point", 1, 5, encode({"hidden": row}))[0], ("hidden",))["hidden"]
    want = decode(host.forward("whole", 3, 5, encode({"hidden": row}))[0], ("hidden",))["hidden"]
    assert torch.equal(got, want)
    with pytest.raises(StepError):
        host.fork("parent", 1, "other", 5, 8)  # a stale step


def test_a_batch_message_gives_each_session_its_bits_alone_and_is_applied_once(tiny):
    """The worker's side of a shared step, in-process: one BatchMessage over two sessions (a decode row and
    a 3-token write with a mask) equals each session's own forward call; a retried batch is answered from its
    output, a batch repeating only some of its steps is refused."""
    host = StageHost(WorkerSettings(port=0, token="t", model=tiny))
    host.assign(None, 0, 2, "float32")
    torch.manual_seed(0)
    prompt = torch.randn(1, 5, 64)
    for sid in ("a", "b", "a1", "b1"):
        host.open(sid, 1, 16)
        host.forward(sid, 2, 0, encode({"hidden": prompt}))
    row, three = torch.randn(1, 1, 64), torch.randn(1, 3, 64)
    mask = torch.ones(1, 3, 8, dtype=torch.bool).tril(5)
    alone_a = decode(host.forward("a1", 3, 5, encode({"hidden": row}))[0], ("hidden",))["hidden"]
    alone_b = decode(host.forward("b1", 3, 5, encode({"hidden": three, "mask": mask}))[0], ("hidden",))["hidden"]
    message = BatchMessage([("a", 5, 1, 3), ("b", 5, 3, 3)], torch.cat([row[0], three[0]]),
                           torch.tensor([5, 5, 6, 7]), [None, mask])
    out, seconds = host.forward_batch(decode_batch(encode_batch(message)))
    hidden = decode(out, ("hidden",))["hidden"]
    assert seconds > 0 and torch.equal(hidden[:1], alone_a[0]) and torch.equal(hidden[1:], alone_b[0])
    assert host.forward_batch(message) == (out, 0.0)  # a retry: not applied twice
    with pytest.raises(StepError):
        host.forward_batch(BatchMessage([("a", 6, 1, 4), ("b", 8, 1, 3)], torch.randn(2, 64),
                                        torch.tensor([6, 8]), [None, None]))
    assert host.steps == {"a": 3, "b": 3, "a1": 3, "b1": 3}


def test_a_refusal_keeps_the_workers_code():
    # the client re-assigns a worker that answers not_assigned (it restarted), by this code
    failure = refusal("w0", {"status": 409, "code": "not_assigned", "message": "no layers assigned"})
    assert type(failure) is StageFailure and (failure.status, failure.code) == (502, "not_assigned")
    assert str(failure) == "worker w0: no layers assigned"
    assert refusal("w0", {"status": 500}).code is None
    assert isinstance(refusal("w0", {"status": 507, "code": "kv_cache_full"}), CapacityError)  # as in-process


def test_the_batch_message_is_checked(worker):
    url, auth = worker
    link = TestLink(url, token_of(auth))
    assert link.op("open", session="m", step=1, capacity=16)["ok"]

    def batch(entries, rows=1, positions=None, **masks) -> bytes:
        from safetensors.torch import save
        tensors = {"hidden": torch.randn(rows, 64), "positions": positions if positions is not None else
                   torch.arange(rows)} | masks
        return save(tensors, metadata=None if entries is None else {"entries": json.dumps(entries)})

    cases = [
        ("no entries", batch(None)),
        ("rows do not add up", batch([["m", 0, 2, 2]])),
        ("a session twice", batch([["m", 0, 1, 2], ["m", 1, 1, 3]], rows=2)),
        ("negative start", batch([["m", -1, 1, 2]])),
        ("bad positions", batch([["m", 0, 1, 2]], positions=torch.tensor([0.5]))),
        ("a mask of the wrong shape", batch([["m", 0, 1, 2]], **{"mask.0": torch.ones(1, 2, 2, dtype=torch.bool)})),
        ("garbage", b"\x08\x00\x00\x00\x00\x00\x00\x00not json"),
    ]
    for label, body in cases:
        link.send({"op": "batch"}, body)
        header, _ = link.answer(None, None)
        assert header["op"] == "error" and header["status"] == 400, (label, header)
        assert header["message"], label
    assert httpx.get(url + "/info", headers=auth).json()["sessions"] == 1  # nothing above touched the session
    link.send({"op": "release", "session": "m"})
    assert sessions(url, auth, 0)
    link.close()
